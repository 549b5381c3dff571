"""The checkpoints and prompts the benchmarks run on, built once under bench_models/.

- T5-large and T5-small shapes with random weights (`build_large`);
- the benchmark pair (`build_pair`): the draft is the demo target (demo/,
  8.4 M parameters), and the target embeds it exactly and adds 18+18 random
  layers whose output projections are scaled down, with FFNs widened to d_ff
  8192 (about 220 M parameters). The draft agrees with it on any prompt, as
  far as the extra layers let it; random weights never agree;
- the demo's held-out prompts, and copy-heavy ones for prompt lookup.

Checkpoints are Hugging Face's, converted by convert.py (and CTranslate2's
converter, references.py).
"""

import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness import DEMO, ROOT

T5_LARGE = dict(vocab_size=32128, d_model=1024, d_ff=4096, num_heads=16, d_kv=64, num_layers=24, initializer_factor=1.0)
T5_SMALL = dict(vocab_size=32128, d_model=512, d_ff=2048, num_heads=8, d_kv=64, num_layers=6, initializer_factor=1.0)
PROMPT_IDS = [13, 52, 999, 81, 7, 402, 33, 91, 18, 640, 22, 5, 77, 301, 9, 1]
# The target grown from the demo target. The scale sets the agreement: at 0.2 the
# table shows acceptance near 0.8, and greedy outputs that still differ from the draft's.
PAIR = dict(extra_layers=18, d_ff=8192, scale=0.2, seed=1)


def build_large(folder: Path, shapes: dict = T5_LARGE) -> Path:
    from checkpoints import make_checkpoint, t5_config

    if not (folder / "config.json").exists():
        print(f"building a random checkpoint of d_model {shapes['d_model']} in {folder} ...", file=sys.stderr)
        make_checkpoint(folder, t5_config(**shapes), 0, DEMO / "target")
    return folder


def build_pair(root: Path) -> tuple[Path, Path]:
    """(target, draft) Hugging Face checkpoints; see the module docstring."""
    import train
    from checkpoints import grow_target

    from loading import load_model

    draft, target = root / "pair-draft", root / "pair-target"
    if not (draft / "config.json").exists():
        train.save_hugging_face(load_model(DEMO / "target"), DEMO / "target", draft)
    if not (target / "config.json").exists():
        print(f"building the benchmark pair's target in {target} ...", file=sys.stderr)
        grow_target(draft, target, **PAIR)
    return target, draft


def convert_measuring_memory(source: Path, out: Path, *options: str) -> int:
    """Run convert.py in a fresh process; return its peak resident memory in bytes."""
    script = (
        "import atexit, re, runpy, sys;"
        "atexit.register(lambda: print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1],"
        " file=sys.stderr));"
        "sys.argv = ['convert.py', *sys.argv[1:]]; runpy.run_path('convert.py', run_name='__main__')"
    )
    argv = ["--model", str(source), "--out", str(out), "--dtype", "float32", "--force", *options]
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"conversion failed: {done.stderr.strip().splitlines()[-1]}")
    return int(done.stderr.split("VmHWM")[-1].split()[0]) * 1024


def memory_read_bandwidth() -> float:
    """Bytes/s summing a 1 GiB array with one thread per core (the machine's read limit)."""
    import numpy as np

    data = np.ones(1 << 28, dtype=np.float32)
    parts = np.array_split(data, os.cpu_count() or 1)
    with ThreadPoolExecutor(len(parts)) as pool:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - start)
    return data.nbytes / statistics.median(times)


def converted(checkpoint: Path, folder: Path) -> Path:
    """folder, converted from the Hugging Face checkpoint by convert.py (float32) the first time."""
    if not (folder / "config.json").exists():
        convert_measuring_memory(checkpoint, folder)
    return folder


def held_out_prompts(count: int | None = None) -> list[str]:
    """The demo's held-out prompts (demo/prompts.txt), the first `count`."""
    lines = [line.decode("utf-8").strip() for line in (DEMO / "prompts.txt").read_bytes().splitlines()]
    return [line for line in lines if line][:count]


def weight_bytes_per_token(model) -> int:
    """Weights one decode step reads: the decoder (cross-attention keys/values
    are computed once per prompt) and the output head."""
    from mlx.utils import tree_flatten

    total = 0
    for name, array in tree_flatten(model.parameters()):
        if name.startswith("encoder.") or ".cross_attention.k." in name or ".cross_attention.v." in name:
            continue
        if name == "shared.weight" and not model.args.tie_word_embeddings:
            continue  # only one embedding row is read
        total += array.nbytes
    return total


def copy_prompts(target, count: int = 20, run: int = 5) -> list[list[int]]:
    """A copy-heavy task for the demo target: held-out code (pieces of 64
    tokens, as the pair was trained on) whose masked 13-token span occurs,
    word for word, earlier in the same piece, kept when the target's own
    greedy filling repeats at least `run` tokens of the prompt in a row (a
    model this small often fills the span otherwise). Pieces are taken in a
    fixed shuffled order of all held-out files."""
    import random

    import train
    from loading import Models
    from options import Settings
    from transformers import AutoTokenizer

    from bench.harness import decode

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO / "target"))  # train.py's helpers take transformers' tokenizers
    sentinel, eos = tokenizer.convert_tokens_to_ids("<extra_id_0>"), tokenizer.eos_token_id
    is_word_start = train.word_starts(tokenizer)
    span, candidates = 13, []
    for piece in train.chunks(tokenizer, train.corpus_files()[1]).tolist():
        for start in range(len(piece) - span - 1, span - 1, -1):  # the last span with an earlier copy
            masked = piece[start : start + span]
            if is_word_start[masked[0]] and any(piece[j : j + span] == masked for j in range(start - span + 1)):
                candidates.append(piece[:start] + [sentinel] + piece[start + span :] + [eos])
                break
    random.Random(0).shuffle(candidates)
    chosen = []
    for prompt in candidates:
        (output,), _, _ = decode(Models(target), [prompt], Settings(max_tokens=30, speculative=False))
        runs = {tuple(prompt[i : i + run]) for i in range(len(prompt) - run + 1)}
        if any(tuple(output[i : i + run]) in runs for i in range(len(output) - run + 1)):
            chosen.append(prompt)
            if len(chosen) == count:
                break
    return chosen


def benchmark_pair(root: Path) -> dict[str, Path]:
    """The benchmark pair's folders: Hugging Face checkpoints (target_hf,
    draft_hf) and what ours loads (target, converted once; draft, the demo target)."""
    target_hf, draft_hf = build_pair(root)
    return {"target_hf": target_hf, "draft_hf": draft_hf, "target": converted(target_hf, root / "pair-target-mlx"),
            "draft": DEMO / "target"}


# The BART family's shapes, from the public configs (random weights): BART-large, and NLLB-200-distilled-600M.
BART_LARGE = dict(model_type="bart", d_model=1024, layers=12, heads=16, ffn=4096, vocab_size=50265, positions=1024)
NLLB_600M = dict(model_type="m2m_100", d_model=1024, layers=12, heads=16, ffn=4096, vocab_size=256206, positions=1024)


def build_family(folder: Path, shapes: dict) -> Path:
    """A random checkpoint of a BART-family shape (init std 0.02, as trained
    ones start), with a made-up word-level tokenizer covering its vocabulary
    (CTranslate2's converter reads the vocabulary from a tokenizer)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    print(f"building a random {shapes['model_type']} checkpoint of d_model {shapes['d_model']} in {folder} ...",
          file=sys.stderr)
    kind = {"bart": ("BartConfig", "BartForConditionalGeneration"),
            "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration")}[shapes["model_type"]]
    config = getattr(transformers, kind[0])(
        vocab_size=shapes["vocab_size"], d_model=shapes["d_model"], encoder_layers=shapes["layers"],
        decoder_layers=shapes["layers"], encoder_attention_heads=shapes["heads"], decoder_attention_heads=shapes["heads"],
        encoder_ffn_dim=shapes["ffn"], decoder_ffn_dim=shapes["ffn"], max_position_embeddings=shapes["positions"],
        scale_embedding=shapes["model_type"] == "m2m_100", pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None, dropout=0.0,
        **({"normalize_before": False, "normalize_embedding": True} if shapes["model_type"] == "bart" else {}))
    # (BART's public configs still carry the last two, which CTranslate2's converter reads)
    torch.manual_seed(0)
    getattr(transformers, kind[1])(config).eval().save_pretrained(str(folder))
    vocabulary = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, shapes["vocab_size"])}
    tokenizer = Tokenizer(WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(str(folder))
    return folder
