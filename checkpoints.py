"""Hugging Face T5 checkpoints built locally, for the tests and the benchmarks (needs PyTorch).

Nothing here downloads: the tokenizer is a SentencePiece model trained on the
Python standard library's sources, the checkpoints are random
`T5ForConditionalGeneration`s saved as Hugging Face would publish them. A
large `initializer_factor` keeps greedy output from collapsing to one repeated
token. `reference_greedy` is the independent reference the tests compare with;
`in_float64` and `farthest_float32` how near float64 transformers' own float32 comes.
"""

import copy
import functools
import glob
import json
import math
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import T5Config, T5ForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent / "demo"))
import train  # noqa: E402  (demo/train.py: the tokenizer trainer)

TOKENIZER_FILES = ["spiece.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
PROMPT = "translate English to French: Let's go to the store and buy some groceries including eggs, avocadoes, and bread."
SP_VOCAB = 1000  # + 100 sentinels = 1100 tokenizer entries


def train_tokenizer(folder: Path) -> Path:
    """A T5-convention tokenizer (pad 0, EOS 1, unk 2, 100 <extra_id_N>) saved in folder."""
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:80]
    lines = [line for f in files for line in Path(f).read_text(encoding="utf-8", errors="ignore").splitlines()]
    return train.train_tokenizer(folder, lines, SP_VOCAB)


def t5_config(vocab_size=1104, **overrides) -> T5Config:
    kwargs = dict(
        vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
        initializer_factor=10.0, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
    )
    kwargs.update(overrides)
    return T5Config(**kwargs)


def make_checkpoint(folder: Path, config: T5Config, seed: int, tokenizer: Path, untied_head=False,
                    format="safetensors", max_shard_size=None) -> T5ForConditionalGeneration:
    """Save a random T5 to folder as Hugging Face would publish it.

    untied_head: a v1.1-style separate lm_head (transformers 5 can no longer
    build one from a config, so it is written into the checkpoint directly).
    format: "safetensors", "bin" (pytorch_model.bin) or "legacy-bin" (the
    pre-zip pickle format of torch < 1.6, which cannot be memory-mapped).
    """
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        state.pop(alias, None)
    if untied_head:
        state["lm_head.weight"] = torch.randn(config.vocab_size, config.d_model) * config.initializer_factor
    else:
        state.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    config_dict = config.to_dict()
    config_dict["tie_word_embeddings"] = not untied_head
    config_dict.pop("scale_decoder_outputs", None)  # as older, published configs
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2))
    _save_weights(folder, state, format, max_shard_size)
    for name in TOKENIZER_FILES:  # tokenizer may be a model's folder
        if (tokenizer / name).is_file():
            (folder / name).write_bytes((tokenizer / name).read_bytes())
    return T5ForConditionalGeneration.from_pretrained(str(folder)).eval()


def _save_weights(folder: Path, state: dict, format: str, max_shard_size) -> None:
    from safetensors.torch import save_file

    names = list(state)
    shards = [names] if not max_shard_size else [names[i : i + max_shard_size] for i in range(0, len(names), max_shard_size)]
    ext, stem = ("safetensors", "model") if format == "safetensors" else ("bin", "pytorch_model")
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"{stem}.{ext}" if len(shards) == 1 else f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}"
        tensors = {n: state[n] for n in shard}
        if format == "safetensors":
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
        else:
            torch.save(tensors, str(folder / file), _use_new_zipfile_serialization=format == "bin")
        weight_map.update({n: file for n in shard})
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))


@torch.no_grad()
def reference_greedy(model: T5ForConditionalGeneration, input_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy ids from full forward passes (no cache): an independent reference."""
    encoder_outputs = model.get_encoder()(input_ids=torch.tensor([input_ids]))
    decoded = [model.config.decoder_start_token_id]
    for _ in range(max_tokens):
        logits = model(encoder_outputs=encoder_outputs, decoder_input_ids=torch.tensor([decoded])).logits
        token = int(logits[0, -1].argmax())
        if token == model.config.eos_token_id:
            break
        decoded.append(token)
    return decoded[1:]


@functools.cache
def in_float64(hf_model):
    """A float64 copy of a transformers model: the reference both float32
    computations are measured against. What the model computes rather than
    stores is computed in float64 too: M2M-100's and NLLB's sinusoidal
    position table, which transformers makes in float32 whatever the model's
    dtype (its own float32 table is up to 7e-5 from the exact one, as ours is)."""
    import torch

    model = copy.deepcopy(hf_model).double().eval()
    for module in model.modules():
        if type(module).__name__ == "M2M100SinusoidalPositionalEmbedding":
            rows, width = module.weights.shape
            half = width // 2
            frequencies = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
            angles = torch.arange(rows, dtype=torch.float64)[:, None] * frequencies[None]
            table = torch.cat([torch.sin(angles), torch.cos(angles), torch.zeros(rows, width % 2, dtype=torch.float64)], 1)
            table[module.padding_idx] = 0
            module.weights = table
    return model


def farthest_float32(hf_model, forward, exact, samples: int = 3, seed: int = 0):
    """transformers' float32 result farthest from float64 (exact) among its own and `samples` copies of the model with
    each weight moved to a float32 neighbour at random (its product by 1 + u, |u| < 2**-23, rounded to float32): how
    far a float32 computation falls by chance alone on a fixture that amplifies rounding (assert_as_near_as_transformers'
    `chance`). Its own run may be a lucky draw: on T5 v1.0's chaotic fixture its encoder output was 9.0e-4 from
    float64 and its copies' 9.2e-3 to 4.2e-2, ours 9.4e-3 to 1.6e-2 as the BLAS sums (BLIS's Zen 3 kernels, packed or not;
    MKL). `forward(model)`: the output, as numpy."""
    import torch

    rng = np.random.default_rng(seed)
    results = [forward(hf_model)]
    for _ in range(samples):
        noisy = copy.deepcopy(hf_model)
        with torch.no_grad():
            for weight in noisy.parameters():
                factor = 1 + torch.from_numpy(rng.uniform(-2**-23, 2**-23, weight.shape))
                weight.copy_((weight.double() * factor).float())
        results.append(forward(noisy))
    return max(results, key=lambda result: np.abs(np.asarray(result, np.float64) - exact).max())


def grow_target(draft: Path, out: Path, extra_layers: int, d_ff: int, scale: float, seed: int) -> Path:
    """A Hugging Face target that embeds the draft checkpoint exactly and is
    much larger: the draft's embedding, norms and layers (FFNs zero-padded to
    d_ff, which leaves them unchanged), then `extra_layers` random layers per
    stack whose output projections are scaled by `scale`. The draft then
    agrees with the target as far as those layers let it, on any prompt."""
    from safetensors.torch import load_file, save_file

    config = T5Config.from_pretrained(str(draft))
    config.num_layers += extra_layers
    config.num_decoder_layers += extra_layers
    config.d_ff = d_ff
    config.initializer_factor = 1.0
    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in T5ForConditionalGeneration(config).state_dict().items()}
    for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        state.pop(alias, None)
    draft_state = load_file(str(draft / "model.safetensors"))
    for name, tensor in state.items():
        if name in draft_state:
            padded = torch.zeros_like(tensor)
            padded[tuple(slice(0, n) for n in draft_state[name].shape)] = draft_state[name]
            state[name] = padded
        elif name.endswith(("SelfAttention.o.weight", "EncDecAttention.o.weight", "DenseReluDense.wo.weight")):
            state[name] = tensor * scale
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (draft / name).is_file():
            (out / name).write_bytes((draft / name).read_bytes())
    return out


PROMPTS = [
    PROMPT,
    "summarize: The quick brown fox jumps over the lazy dog near the river bank.",
    "def parse(text): return [line.split() for line in text.splitlines()]",
    "translate English to German: The weather is nice today.",
    "question: what does the os module provide? context: portable operating system interfaces",
    "class Queue: a first-in first-out list with put and get methods",
]


def perturbed_copy(source: Path, out: Path, noise: float, seed: int) -> Path:
    """A draft that mostly agrees with its target: the target's weights plus relative noise."""
    out.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(source / "model.safetensors"))
    for name, tensor in state.items():
        state[name] = tensor + noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def exact_first_token_distribution(hf_model, prompt, temp, top_p, after: tuple = ()) -> np.ndarray:
    """The target's distribution of its first token (or of the one after
    the tokens `after`), from transformers' logits."""
    with torch.no_grad():
        decoded = torch.tensor([[0, *after]])
        logits = hf_model(input_ids=torch.tensor([prompt]), decoder_input_ids=decoded).logits[0, -1].double()
    probs = torch.softmax(logits / temp, dim=-1).numpy()
    if top_p < 1:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0) / probs[mask].sum()
    return probs


# ---------------------------------------------------------------- the other families

# model_type -> (config class, model class, its decoder's start token, the config's own switches), and the
# init_std and seed whose greedy output varies (asserted where used)
FAMILY_CHECKPOINTS = {
    "bart": ("BartConfig", "BartForConditionalGeneration", 2, {}, 2.0, 6),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", 2, {"scale_embedding": True}, 1.0, 5),
    "marian": ("MarianConfig", "MarianMTModel", 1, {"activation_function": "swish"}, 2.0, 3),
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", 2, {}, 2.0, 6),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", 1, {}, 3.0, 0),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", 0, {}, 2.0, 9),  # T5's layout: initializer_factor
    "ul2": ("T5Config", "T5ForConditionalGeneration", 0, {}, 2.0, 1),  # Flan-UL2's: gated SiLU, wide heads
}


# Prompts of ids for the families' random checkpoints (the BART family's EOS is 2; umT5's, 1, ends its prompts' second
# token instead: no matter to the model).
FAMILY_PROMPTS = [[5, 17, 300, 41, 99, 7, 250, 13, 600, 88, 2], [44, 9, 512, 3, 77, 2], [900, 31, 8, 8, 100, 64, 12, 2]]


def family_checkpoint(kind: str, folder: Path, tokenizer: Path, seed: int | None = None, layers: int = 2,
                      vocab_size: int = 1104, std: float | None = None, d_model: int = 64, heads: int = 4):
    """A random checkpoint of `kind` (the BART family's with pad 1 and EOS 2,
    as theirs; umT5's with T5's), saved to folder as transformers saves it,
    with the test tokenizer's files beside it (ids are what the tests compare).
    The FFN is twice d_model wide."""
    import transformers

    config_class, model_class, start, switches, default_std, default_seed = FAMILY_CHECKPOINTS[kind]
    std = default_std if std is None else std
    if kind in ("umt5", "ul2"):  # v1.1's layout: umT5 with a relative position bias in every layer, UL2's heads wider
        config = getattr(transformers, config_class)(
            vocab_size=vocab_size, d_model=d_model, d_kv=(2 if kind == "ul2" else 1) * d_model // heads, d_ff=2 * d_model,
            num_layers=layers, num_heads=heads, initializer_factor=std, decoder_start_token_id=0, eos_token_id=1,
            pad_token_id=0, feed_forward_proj="gated-silu" if kind == "ul2" else "gated-gelu", tie_word_embeddings=False,
            dropout_rate=0.0)
    else:
        config = getattr(transformers, config_class)(
            vocab_size=vocab_size, d_model=d_model, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
            decoder_attention_heads=heads, encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model,
            max_position_embeddings=256, init_std=std,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            forced_eos_token_id=None, decoder_start_token_id=start, **switches)
    torch.manual_seed(default_seed if seed is None else seed)
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            (folder / name).write_bytes((tokenizer / name).read_bytes())
    return model


def openai_whisper_tokenizer():
    """openai-whisper's tokenizer module (mlx-whisper's copy, loaded alone: the package imports numba) and its
    multilingual vocabulary file; None where mlx-whisper or tiktoken is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("mlx_whisper")
    if spec is None or importlib.util.find_spec("tiktoken") is None:
        return None
    root = Path(spec.submodule_search_locations[0])
    module_spec = importlib.util.spec_from_file_location("openai_whisper_tokenizer", root / "tokenizer.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module, root / "assets" / "multilingual.tiktoken"


def save_whisper_vocabulary(folder: Path) -> object:
    """Whisper's real multilingual vocabulary (99 languages, large-v2's), as transformers' converter makes a
    tokenizer.json of openai-whisper's file, saved in folder with the special tokens in Whisper's order; returns
    openai-whisper's own tokenizer of it (the reference). Needs mlx-whisper and tiktoken."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    module, ranks = openai_whisper_tokenizer()
    theirs = module.get_tokenizer(multilingual=True, num_languages=99)
    specials = sorted(theirs.encoding._special_tokens.items(), key=lambda item: item[1])
    converted = TikTokenConverter(vocab_file=str(ranks), pattern=theirs.encoding._pat_str).converted()
    converted.add_special_tokens([AddedToken(token, special=True) for token, _ in specials])
    Path(folder).mkdir(parents=True, exist_ok=True)
    converted.save(str(Path(folder) / "tokenizer.json"))
    return theirs
