"""python -m bench COMMAND: run a measurement, write bench/results/COMMAND.json and print its table
(bench/__init__.py lists the commands)."""

import argparse
import sys
from pathlib import Path

from bench.harness import DEMO, ROOT

BATCHES = "regular,speculative,steps"  # what `python -m bench` runs without a command


def build_parser() -> argparse.ArgumentParser:
    from bench import COMMANDS

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("which", nargs="?", choices=[*COMMANDS, "render", "all"], default="all",
                        help=f"a measurement, render (docs/PERFORMANCE.md and the README's table from bench/results/), "
                        f"or all ({BATCHES})")
    parser.add_argument("--tokens", type=int, default=100,
                        help="tokens to generate (speculative, fresh's one-shot runs: at most, EOS stops)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-draft", type=int, default=4,
                        help="speculative, fresh, serve, stages: draft tokens per verify step")
    parser.add_argument("--prompts", type=int,
                        help="speculative, fresh's one-shot runs: how many held-out demo prompts (default 6); "
                        "batch: how many prompts (default 32, the demo's repeated)")
    parser.add_argument("--batch-sizes", default="1,4,8,16", help="batch: batch sizes")
    parser.add_argument("--num-drafts",
                        help="batch, drafting, fresh, serve: fixed num-draft values (default 1,2,3,4; drafting: 1,2,3,4,5,6,8; "
                        "serve: 2,3,4, beside regular decoding and auto)")
    parser.add_argument("--pairs", help="batch, drafting, lookup, serve: only these pairs (demo, benchmark)")
    parser.add_argument("--shapes", help="steps: only these shapes (demo, small, deep, large); "
                        "whisper: tiny.en, base (real weights, the default); random weights at tiny's, small's, "
                        "large-v3-turbo's; whisper-profile: tiny.en, base")
    parser.add_argument("--clients", help="serve: concurrent client counts (default 1,4,16,64)")
    parser.add_argument("--lengths", default="128,512,2048,8192", help="encode: input lengths in tokens")
    parser.add_argument("--dir", type=Path, default=ROOT / "bench_models", help="where checkpoints are built and kept")
    # The workers each measurement starts in processes of its own.
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    parser.add_argument("--ct2-worker", help=argparse.SUPPRESS)
    parser.add_argument("--whisper-worker", help=argparse.SUPPRESS)
    parser.add_argument("--whisper-profile-worker", help=argparse.SUPPRESS)
    parser.add_argument("--whisper-reference", default="transformers", help=argparse.SUPPRESS)
    parser.add_argument("--references", help="whisper: only these references beside transformers (mlx-whisper, "
                        "faster-whisper; mlx-whisper on a CPU takes most of the run's time)")
    parser.add_argument("--assistant", help=argparse.SUPPRESS)
    parser.add_argument("--cache-fix", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-worker", help=argparse.SUPPRESS)
    parser.add_argument("--stages-worker", help=argparse.SUPPRESS)
    parser.add_argument("--encode-worker", help=argparse.SUPPRESS)
    parser.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blas-worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def worker(args) -> bool:
    """Run the worker the arguments name, if any (before mlx.core for ours, never for the references)."""
    if args.whisper_worker:
        from bench import speech

        speech.whisper_worker(args.whisper_worker, args.whisper_reference)
        return True
    if args.whisper_profile_worker:
        from bench import speech_profile

        speech_profile.profile_worker(args.whisper_profile_worker, args.whisper_reference)
        return True
    if args.hf_worker or args.ct2_worker:
        from bench import references

        if args.hf_worker:
            references.hf_worker(args.hf_worker, args.assistant, args.num_draft, args.cache_fix)
        else:
            references.ct2_worker(args.ct2_worker)
        return True
    if not (args.blas_worker or args.encode_worker or args.decode_worker or args.stages_worker):
        return False
    import cpu  # noqa: F401  (before mlx.core)

    from bench import blas, long_inputs, memory, stages

    if args.stages_worker:
        stages.stages_worker(args.stages_worker)
    elif args.blas_worker:
        blas.blas_worker()
    elif args.encode_worker:
        long_inputs.encode_worker(args.encode_worker, args.tokens, args.hf)
    else:
        memory.decode_worker(args.decode_worker, args.tokens)
    return True


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if worker(args):
        return
    import cpu  # noqa: F401  (before mlx.core, which the measurements import)

    from bench import COMMANDS, render
    from bench.harness import report

    if args.which == "render":
        render.write()
        return
    sys.path.insert(0, str(DEMO))  # demo/train.py: the pair's draft as a Hugging Face checkpoint, held-out losses
    args.dir.mkdir(parents=True, exist_ok=True)
    for name in BATCHES.split(",") if args.which == "all" else [args.which]:
        _, run, render_table = COMMANDS[name]
        report(name, argv if args.which != "all" else [name, *argv], run(args), render_table)


if __name__ == "__main__":
    main(sys.argv[1:])
