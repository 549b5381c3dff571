"""Small random Hugging Face T5 checkpoints and a locally trained tokenizer.

Nothing here downloads: the tokenizer is a SentencePiece model trained on the
Python standard library's sources, the checkpoints are random
`T5ForConditionalGeneration`s saved with `save_pretrained`. A large
`initializer_factor` keeps greedy output from collapsing to one repeated token.
"""

import glob
import json
import sysconfig
from pathlib import Path

import torch
import train  # demo/train.py
from transformers import T5Config, T5ForConditionalGeneration

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
    for file in tokenizer.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
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
