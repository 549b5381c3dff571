"""Run T5 in MLX: regular or speculative (draft-and-verify) decoding.

    python main.py                                   # t5-11b verifies what t5-small drafts
    python main.py --regular-decode --prompt "summarize: ..."
    python main.py --model t5-small --regular-decode --json
"""

import argparse
import json
import sys
from pathlib import Path

import blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from decoder import Sampling, Stats, regular_generate
from model import NotAConvertedModel, load_model, load_tokenizer, read_config

DEFAULT_PROMPT = (
    "translate English to French: Let's go to the store and buy some groceries "
    "including eggs, avocadoes, and bread."
)
MODELS_DIR = Path("mlx_models")


class UsageError(Exception):
    """Bad input from the user; printed as one line."""


def resolve_model(name: str) -> Path:
    """A converted folder path, else mlx_models/NAME."""
    for folder in (Path(name).expanduser(), MODELS_DIR / name):
        if folder.is_dir():
            try:
                read_config(folder)
            except NotAConvertedModel as e:
                raise UsageError(str(e))
            return folder
    raise UsageError(f"no converted model '{name}': run `python convert.py --model {name}` first")


def check_args(args) -> None:
    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if args.temp < 0:
        raise UsageError(f"--temp must be >= 0 (got {args.temp})")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (got {args.top_p})")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (got {args.top_k})")
    if args.num_draft < 1:
        raise UsageError(f"--num-draft must be at least 1 (got {args.num_draft})")
    if not 0 <= args.delta <= 1:
        raise UsageError(f"--delta must be in [0, 1] (got {args.delta})")


def stream_text(tokens_iter, tokenizer, out=sys.stdout) -> tuple[list[int], str]:
    """Print text as tokens arrive. Decoding the whole prefix each time keeps
    SentencePiece spacing right; an incomplete UTF-8 sequence is held back."""
    tokens, printed = [], ""
    for token in tokens_iter:
        tokens.append(token)
        text = tokenizer.decode(tokens)
        if text.endswith("\ufffd") or not text.startswith(printed):
            continue
        out.write(text[len(printed):])
        out.flush()
        printed = text
    text = tokenizer.decode(tokens)
    if text.startswith(printed):
        out.write(text[len(printed):])
    out.write("\n")
    out.flush()
    return tokens, text


def stats_line(stats: Stats, speculative: bool) -> str:
    line = f"{stats.generated} tokens in {stats.seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s), {stats.target_calls} target steps"
    if speculative:
        line += (
            f"; accepted {stats.accepted} / {stats.drafted} drafts ({stats.acceptance_rate:.0%}),"
            f" {stats.tokens_per_target_call:.2f} tokens per target step"
        )
    return line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="t5-11b", help="target model: converted folder, or a name under mlx_models/")
    p.add_argument("--draft-model", default="t5-small", help="draft model for speculative decoding")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="input text")
    p.add_argument("--max-tokens", type=int, default=100, help="most tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    p.add_argument("--num-draft", type=int, default=5, help="draft tokens per verify step")
    p.add_argument("--delta", type=float, default=0.1, help="acceptance lenience in [0, 1]: 0 exact, 1 accepts every draft")
    p.add_argument("--regular-decode", action="store_true", help="decode with the target alone")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming")
    return p


def run(args) -> int:
    check_args(args)
    if not args.regular_decode:
        raise UsageError("speculative decoding is not available yet: pass --regular-decode")
    target_dir = resolve_model(args.model)
    model = load_model(target_dir)
    tokenizer = load_tokenizer(target_dir)
    if args.seed is not None:
        mx.random.seed(args.seed)
    prompt = tokenizer(args.prompt).input_ids
    sampling = Sampling(args.temp, args.top_k, args.top_p)
    stats = Stats()
    tokens_iter = regular_generate(model, prompt, args.max_tokens, sampling, stats)
    if args.json:
        tokens = list(tokens_iter)
        result = {"text": tokenizer.decode(tokens), "tokens": tokens, "stats": stats.to_dict()}
        print(json.dumps(result))
    else:
        stream_text(tokens_iter, tokenizer)
        print(stats_line(stats, speculative=False))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
