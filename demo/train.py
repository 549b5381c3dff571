"""Train the demo pair: a small T5 target and a much smaller T5 draft.

The target learns T5's span-corruption objective on the Python standard
library's own sources: spans of a text are replaced by sentinels
(<extra_id_0>, ...) in the input, and the output spells out each sentinel's
span. The draft then learns the target's predictions on the same kind of
examples (distillation), so that it proposes what the target would accept.
The SentencePiece tokenizer is trained on the same text. Files are split by
name into training and held-out sets; held-out loss is printed as training
goes, and held-out prompts are written for `main.py --demo`.

    python demo/train.py                         # ~50 minutes on 2 CPU cores
    python demo/train.py --steps 20 --out /tmp/demo  # a quick try

Writes, under --out (default: demo/):
    target/, draft/        converted MLX models (python main.py --model demo/target)
    prompts.txt            held-out prompts, one a line
    training.json          sizes, steps and held-out losses of both models
    hf/target, hf/draft    the same models as Hugging Face checkpoints (not committed)

Same seed, Python (the corpus is its standard library), package versions and
thread count: same models.
"""

import argparse
import itertools
import json
import shutil
import sys
import sysconfig
import time
import zlib
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cpu  # noqa: E402  (before mlx.core)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import convert  # noqa: E402
from model import EncoderDecoder, ModelArgs  # noqa: E402

SP_VOCAB = 2000  # SentencePiece pieces; the tokenizer adds 100 sentinels
NUM_SENTINELS = 100
# The two models: v1.0-style T5 (ReLU, head tied to the embedding), as
# t5-small and t5-11b. fp32 weights: about 34 MB and 5 MB.
SIZES = {
    "target": dict(d_model=256, d_kv=64, num_heads=4, d_ff=512, num_layers=6, num_decoder_layers=6),
    "draft": dict(d_model=128, d_kv=32, num_heads=4, d_ff=512, num_layers=2, num_decoder_layers=2),
}
# Sized to finish within an hour on 2 cores: ~1.6 s a target step, ~0.8 s a
# draft step (its own ~0.35 s plus the target's predictions it learns from).
STEPS = {"target": 1200, "draft": 1000}
BATCH = 64
LEARNING_RATE = 3e-2  # relative to each weight's RMS (Adafactor), decayed to a tenth

# Span corruption as in T5 (random spans replaced by sentinels), but one span
# of 13 tokens, starting at a word, in 64 tokens of text. With T5's 19 short
# spans in 228 tokens the models had, after an hour here, learned only which
# tokens a file uses: the decoder never learned to find its sentinels in the
# input (swapping sentinel ids in the input left the loss unchanged), and
# greedy output filled every span with the same word. Inputs are always 53
# tokens, targets 15.
RAW_LENGTH = 64
NOISE_DENSITY = 0.2
MEAN_SPAN = 13.0
HELDOUT_PERCENT = 10
SKIP_DIRS = {"site-packages", "encodings"}  # installed packages; codec tables


# ---------------------------------------------------------------- corpus


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training, held-out) standard-library sources, split by a hash of the name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if not SKIP_DIRS & set(f.relative_to(stdlib).parts[:-1]))
    heldout = [f for f in files if zlib.crc32(str(f.relative_to(stdlib)).encode()) % 100 < HELDOUT_PERCENT]
    training = [f for f in files if f not in set(heldout)]
    return training, heldout


def read(file: Path) -> str:
    return file.read_text(encoding="utf-8", errors="ignore")


def train_tokenizer(folder: Path, lines, vocab_size: int) -> Path:
    """A T5-convention tokenizer (pad 0, EOS 1, unk 2, 100 <extra_id_N>) saved in folder."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    shutil.rmtree(folder, ignore_errors=True)  # a stale tokenizer.json would win over the new model
    folder.mkdir(parents=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "spiece"), vocab_size=vocab_size,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, model_type="unigram",
        character_coverage=1.0, num_threads=1, minloglevel=2,
    )
    (folder / "spiece.vocab").unlink()
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": NUM_SENTINELS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))  # adds tokenizer.json
    return folder


def chunks(tokenizer, files: list[Path]) -> np.ndarray:
    """(N, RAW_LENGTH) token ids: each file cut into whole pieces, the tail dropped."""
    ids = tokenizer([read(f) for f in files], add_special_tokens=False).input_ids
    pieces = [doc[i : i + RAW_LENGTH] for doc in ids for i in range(0, len(doc) - RAW_LENGTH + 1, RAW_LENGTH)]
    return np.array(pieces, dtype=np.int32)


def word_starts(tokenizer) -> np.ndarray:
    """For each token id: does it begin a word? (A piece after a space, other
    than the lone space piece, which begins no word of its own.)"""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return np.array([p.startswith("\u2581") and len(p) > 1 for p in pieces])


def noise_mask(can_start: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """T5's random spans: exactly round(length * density) noise tokens in
    round(noise / MEAN_SPAN) spans between random runs of kept tokens, with a
    kept token first and last (T5 always ends on a span, which puts a lone
    span at the very end). Each span starts where can_start is True (a word),
    as near to its random start as fits.

    Spans starting anywhere taught the models to begin most spans with the
    lone space piece, so greedy output filled every span with it."""
    length = len(can_start)
    num_noise = round(length * NOISE_DENSITY)
    num_spans = round(num_noise / MEAN_SPAN)

    def split(total: int, runs: int) -> np.ndarray:  # `total` items into `runs` non-empty runs
        cuts = np.sort(rng.choice(np.arange(1, total), runs - 1, replace=False))
        return np.diff(np.concatenate([[0], cuts, [total]]))

    spans, kept = split(num_noise, num_spans), split(length - num_noise, num_spans + 1)
    ideal = np.cumsum(kept[:-1]) + np.concatenate([[0], np.cumsum(spans)[:-1]])  # random starts
    allowed = np.flatnonzero(can_start[1:]) + 1
    # latest[j]: the last allowed start of span j that leaves room for the spans after it.
    latest, limit = np.zeros(num_spans, dtype=int), length - 1
    for j in reversed(range(num_spans)):
        fits = allowed[allowed + spans[j] <= limit]
        if len(fits) == 0:  # too few word starts (a long string, say): spans start anywhere
            return noise_mask(np.ones(length, dtype=bool), rng)
        latest[j] = fits[-1]
        limit = latest[j] - 1  # a kept token between spans
    mask, earliest = np.zeros(length, dtype=bool), 1
    for j in range(num_spans):
        choices = allowed[(allowed >= earliest) & (allowed <= latest[j])]
        start = choices[np.argmin(np.abs(choices - ideal[j]))]
        mask[start : start + spans[j]] = True
        earliest = start + spans[j] + 1
    return mask


def corrupt(ids: np.ndarray, mask: np.ndarray, sentinels: list[int], eos: int) -> tuple[list, list]:
    """Input: ids with each noise span replaced by a sentinel. Target: each
    sentinel followed by the span it replaced."""
    inputs, targets, spans = [], [], 0
    for i, (token, noisy) in enumerate(zip(ids.tolist(), mask)):
        if noisy:
            if i == 0 or not mask[i - 1]:
                inputs.append(sentinels[spans])
                targets.append(sentinels[spans])
                spans += 1
            targets.append(token)
        else:
            inputs.append(token)
    return inputs + [eos], targets + [eos]


def batches(pieces: np.ndarray, is_word_start: np.ndarray, rng: np.random.Generator, sentinels: list[int], eos: int):
    """Endless (inputs, decoder inputs, targets) batches; fresh masks every
    epoch. is_word_start[id]: whether a span may start at token id."""
    while True:
        order = rng.permutation(len(pieces))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            examples = [corrupt(pieces[i], noise_mask(is_word_start[pieces[i]], rng), sentinels, eos)
                        for i in order[start : start + BATCH]]
            yield to_arrays(examples)


def to_arrays(examples):
    inputs = mx.array([e[0] for e in examples])
    targets = mx.array([e[1] for e in examples])
    # The decoder sees the target shifted right behind the start token (pad, 0).
    decoder_inputs = mx.concatenate([mx.zeros((len(examples), 1), mx.int32), targets[:, :-1]], axis=1)
    return inputs, decoder_inputs, targets


# ---------------------------------------------------------------- training


def initialize(model: EncoderDecoder, seed: int) -> None:
    """T5's initialisation (factor 1): attention scores are not scaled by
    1/sqrt(d_kv) at run time, so queries start that much smaller."""
    mx.random.seed(seed)
    a = model.args
    scales = {"q": (a.d_model * a.d_kv) ** -0.5, "k": a.d_model**-0.5, "v": a.d_model**-0.5,
              "o": (a.num_heads * a.d_kv) ** -0.5, "wi": a.d_model**-0.5, "wo": a.d_ff**-0.5,
              "embeddings": a.d_model**-0.5, "shared": 1.0}
    weights = []
    for name, value in tree_flatten(model.parameters()):
        parts = name.split(".")
        if "norm" in name:
            weights.append((name, mx.ones_like(value)))
        else:
            scale = scales[parts[-2]]
            weights.append((name, scale * mx.random.normal(value.shape)))
    model.load_weights(weights)


def logits_of(model: EncoderDecoder, inputs, decoder_inputs) -> mx.array:
    """One stream (lanes=()): training's products take MKL's own threads (cpu.set_threads)."""
    return model.decode(decoder_inputs, model.make_cache(model.encode(inputs, lanes=()), lanes=()))


def loss_fn(model: EncoderDecoder, inputs, decoder_inputs, targets) -> mx.array:
    """Cross-entropy against the true tokens."""
    logits = logits_of(model, inputs, decoder_inputs)
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


def distillation_loss(model: EncoderDecoder, inputs, decoder_inputs, teacher_logits) -> mx.array:
    """Cross-entropy against the teacher's distribution: the student learns
    what the teacher would predict, not the text."""
    log_probs = nn.log_softmax(logits_of(model, inputs, decoder_inputs), axis=-1)
    return -(mx.softmax(teacher_logits, axis=-1) * log_probs).sum(axis=-1).mean()


def agreement(model: EncoderDecoder, teacher: EncoderDecoder, held: list) -> float:
    """How often the two models' argmax agree at each target position, fed
    the true text (the sentinel and EOS positions included). Drafting for
    the teacher, every token is this choice, but after a first disagreement
    greedy decoding goes on from the teacher's text, not the true one."""
    same = total = 0
    for inputs, decoder_inputs, _ in held:
        ours, theirs = (logits_of(m, inputs, decoder_inputs).argmax(-1) for m in (model, teacher))
        same, total = same + (ours == theirs).sum().item(), total + ours.size
    return same / total


def train(model: EncoderDecoder, data, heldout: list, steps: int, log, teacher: EncoderDecoder | None = None) -> list[dict]:
    """Train on data's batches; with a teacher, learn the teacher's
    predictions instead of the true tokens."""
    # Adafactor as T5 was trained: updates scale with each weight's RMS. With
    # T5's initialisation (queries ~100x smaller than embeddings) plain Adam
    # moved queries by tens of percent a step and the decoder never learned to
    # read the encoder (loss stuck near the unigram entropy). Momentum (beta_1,
    # which T5 left out to save memory) made the held-out loss fall markedly
    # faster in trial runs.
    optimizer = optim.Adafactor(learning_rate=optim.cosine_decay(LEARNING_RATE, steps, LEARNING_RATE / 10),
                                relative_step=False, scale_parameter=True, beta_1=0.9)
    state = [model.state, optimizer.state]

    objective = loss_fn if teacher is None else distillation_loss

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*batch):
        loss, grads = nn.value_and_grad(model, objective)(model, *batch)
        optimizer.update(model, grads)
        return loss

    start, recent, history = time.perf_counter(), [], []
    for number in range(1, steps + 1):
        inputs, decoder_inputs, targets = next(data)
        labels = targets if teacher is None else logits_of(teacher, inputs, decoder_inputs)
        loss = step(inputs, decoder_inputs, labels)
        mx.eval(state)
        recent.append(loss.item())
        if number % 200 == 0 or number == steps:
            # With a teacher, train_loss is against the teacher's distribution
            # (its entropy included); heldout_loss is always against the text.
            history.append({"step": number, "train_loss": sum(recent) / len(recent),
                            "heldout_loss": heldout_loss(model, heldout)})
            against = "train loss" if teacher is None else "loss against the target"
            line = (f"  step {number:5d}/{steps}  {against} {history[-1]['train_loss']:.3f}  "
                    f"held-out loss {history[-1]['heldout_loss']:.3f}")
            if teacher is not None:
                history[-1]["heldout_agreement"] = agreement(model, teacher, heldout)
                line += f"  agrees with the target {history[-1]['heldout_agreement']:.3f}"
            log(f"{line}  ({(time.perf_counter() - start) / 60:.1f} min)")
            recent = []
    return history


# ---------------------------------------------------------------- saving


def hf_names(args: ModelArgs) -> list[str]:
    """Every weight of a Hugging Face v1.0 T5 of these sizes, in its naming."""
    names = ["shared.weight"]
    stacks = [("encoder", args.num_layers, ["SelfAttention", "DenseReluDense"]),
              ("decoder", args.num_decoder_layers, ["SelfAttention", "EncDecAttention", "DenseReluDense"])]
    for stack, count, sublayers in stacks:
        names += [f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", f"{stack}.final_layer_norm.weight"]
        for i in range(count):
            for j, sublayer in enumerate(sublayers):
                projections = ["wi", "wo"] if sublayer == "DenseReluDense" else ["q", "k", "v", "o"]
                names += [f"{stack}.block.{i}.layer.{j}.{sublayer}.{p}.weight" for p in projections]
                names.append(f"{stack}.block.{i}.layer.{j}.layer_norm.weight")
    return names


def save_hugging_face(model: EncoderDecoder, tokenizer_dir: Path, folder: Path) -> Path:
    """The model as a Hugging Face checkpoint, named through convert.py's own table."""
    from transformers import T5Config

    ours = dict(tree_flatten(model.parameters()))
    weights = {name: ours[convert.rename(name)] for name in hf_names(model.args)}
    assert {convert.rename(n) for n in weights} == set(ours), "hf_names and convert.RENAMES disagree"
    a = model.args
    config = T5Config(
        vocab_size=a.vocab_size, d_model=a.d_model, d_kv=a.d_kv, d_ff=a.d_ff, num_heads=a.num_heads,
        num_layers=a.num_layers, num_decoder_layers=a.num_decoder_layers, feed_forward_proj=a.feed_forward_proj,
        relative_attention_num_buckets=a.relative_attention_num_buckets,
        relative_attention_max_distance=a.relative_attention_max_distance,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, tie_word_embeddings=True,
        architectures=["T5ForConditionalGeneration"],
    )
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    for name in convert.TOKENIZER_FILES:  # tokenizer_dir may be a converted model's folder
        if (tokenizer_dir / name).is_file():
            (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return folder


def write_prompts(path: Path, tokenizer, pieces: np.ndarray, is_word_start, count: int, rng, sentinels, eos) -> None:
    """Held-out text with spans masked: what the models were trained to fill in."""
    picked = rng.choice(len(pieces), count, replace=False)
    lines = []
    for i in picked:
        inputs, _ = corrupt(pieces[i], noise_mask(is_word_start[pieces[i]], rng), sentinels, eos)
        lines.append(tokenizer.decode(inputs[:-1]))
    path.write_text("\n".join(lines) + "\n")


def heldout_split(tokenizer, heldout: np.ndarray, seed: int) -> tuple[np.ndarray, list]:
    """(shuffled held-out pieces, the 8 batches of the held-out loss). The batches
    are drawn from all held-out files (consecutive pieces would come from two
    or three files); the prompts come from the pieces after them."""
    sentinels = tokenizer.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(NUM_SENTINELS)])
    shuffled = heldout[np.random.default_rng(seed + 3).permutation(len(heldout))]
    data = batches(shuffled[: 8 * BATCH], word_starts(tokenizer), np.random.default_rng(seed + 1), sentinels,
                   tokenizer.eos_token_id)
    return shuffled, list(itertools.islice(data, 8))


def heldout_loss(model: EncoderDecoder, held: list) -> float:
    """Mean cross-entropy per target token over the held-out batches (nats)."""
    return float(np.mean([loss_fn(model, *batch).item() for batch in held]))


def dequantized(model: EncoderDecoder) -> EncoderDecoder:
    """The same model with float layers holding its quantized weights,
    dequantized: the function the quantized products compute, up to float
    rounding, in BLAS products (on the CPU, MLX's quantized products are
    several times slower for a batch of many rows)."""
    from mlx.utils import tree_map

    def to_float(module):
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            weight = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits, mode=module.mode)
            layer = nn.Linear(1, 1, bias=False) if isinstance(module, nn.QuantizedLinear) else nn.Embedding(1, 1)
            layer.weight = weight
            return layer
        return module

    model.update_modules(tree_map(to_float, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return model


def evaluate(folders: list[Path], seed: int = 0) -> dict[str, float]:
    """The held-out loss of converted models (quantized ones too) on the
    batches training reported, rebuilt from the first model's tokenizer."""
    from transformers import AutoTokenizer

    from loading import load_model

    tokenizer = AutoTokenizer.from_pretrained(str(folders[0]))
    _, held = heldout_split(tokenizer, chunks(tokenizer, corpus_files()[1]), seed)
    return {str(folder): heldout_loss(dequantized(load_model(folder)), held) for folder in folders}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "demo", help="output folder (default: demo/)")
    parser.add_argument("--steps", type=int, help="training steps for each model (default: target %d, draft %d)"
                        % (STEPS["target"], STEPS["draft"]))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="BLAS threads for the matrix products")
    parser.add_argument("--evaluate", type=Path, nargs="+", metavar="FOLDER",
                        help="train nothing: print the held-out loss of these converted models (nats per token)")
    args = parser.parse_args(argv)
    cpu.set_threads(args.threads)
    if args.evaluate:
        for folder, loss in evaluate(args.evaluate, args.seed).items():
            print(f"{folder}: held-out loss {loss:.4f}")
        return 0
    from transformers import AutoTokenizer

    began = time.perf_counter()
    training_files, heldout_files = corpus_files()
    print(f"Corpus: {len(training_files)} training and {len(heldout_files)} held-out files of "
          f"{sysconfig.get_paths()['stdlib']}")
    tokenizer_dir = args.out / "hf" / "tokenizer"
    lines = (line for f in training_files for line in read(f).splitlines() if line.strip())
    train_tokenizer(tokenizer_dir, lines, SP_VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    sentinels = tokenizer.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(NUM_SENTINELS)])
    eos = tokenizer.eos_token_id
    starts = word_starts(tokenizer)
    training, heldout = chunks(tokenizer, training_files), chunks(tokenizer, heldout_files)
    print(f"Tokens: {training.size:,} training, {heldout.size:,} held-out, in pieces of {RAW_LENGTH}")
    shuffled, heldout_batches = heldout_split(tokenizer, heldout, args.seed)

    summary = {"seed": args.seed, "python": sys.version.split()[0], "sp_vocab": SP_VOCAB, "batch": BATCH}

    def build(name: str, index: int, teacher: EncoderDecoder | None) -> EncoderDecoder:
        """Train one model of SIZES[name] and save it both ways."""
        sizes = SIZES[name]
        model = EncoderDecoder(ModelArgs(vocab_size=len(tokenizer), **sizes))
        initialize(model, args.seed + index)
        parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
        steps = args.steps or STEPS[name]
        print(f"Training {name}: {parameters / 1e6:.1f}M parameters, {steps} steps of {BATCH} examples"
              + (" on the target's predictions" if teacher is not None else ""))
        data = batches(training, starts, np.random.default_rng(args.seed + 100 + index), sentinels, eos)
        history = train(model, data, heldout_batches, steps, print, teacher=teacher)
        summary[name] = {**sizes, "parameters": parameters, "steps": steps, **history[-1], "history": history}
        hf_dir = save_hugging_face(model, tokenizer_dir, args.out / "hf" / name)
        convert.convert(str(hf_dir), args.out / name, "float32", force=True)
        return model

    # The target learns the text; the draft then learns the target's
    # predictions (distillation), which is what speculative decoding rewards:
    # in trial runs such a draft agreed with the target more, in fewer steps,
    # than one trained on the text.
    target = build("target", 0, teacher=None)
    build("draft", 1, teacher=target)

    write_prompts(args.out / "prompts.txt", tokenizer, shuffled[8 * BATCH :], starts, 20, np.random.default_rng(args.seed + 2),
                  sentinels, eos)
    summary["minutes"] = round((time.perf_counter() - began) / 60, 1)
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"Done in {summary['minutes']} min: {args.out / 'target'}, {args.out / 'draft'}, {args.out / 'prompts.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
