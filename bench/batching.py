"""`batch`: batched decoding by batch size, against transformers' batched generate."""

import statistics
import time

from bench import fixtures
from bench.fixtures import DEMO
from bench.harness import decode, ratio, table
from bench.references import HFWorker


# ---------------------------------------------------------------- batch


def run_batch(args) -> dict:
    """Throughput over many prompts, by batch size: our batched speculative
    decoding at each num-draft, our batched regular decoding, and
    transformers' batched generate (its assisted mode takes no batches), with
    both models' encoding alone as the floor under a run. Batch size 1 is
    prompt-by-prompt decoding. Runs alternate within a pass; medians over passes."""
    from rows import encode_for
    from loading import Models, load_model, load_tokenizer
    from options import Settings

    bench_pair = fixtures.benchmark_pair(args.dir)
    pairs = {"demo pair": (DEMO / "target", DEMO / "draft", bench_pair["draft_hf"]),
             "benchmark pair": (bench_pair["target"], bench_pair["draft"], bench_pair["target_hf"])}
    tokenizer = load_tokenizer(DEMO / "target")
    demo = fixtures.held_out_prompts()
    prompts = [tokenizer.encode(demo[i % len(demo)]) for i in range(args.prompts or 32)]
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    num_drafts = [int(k) for k in (args.num_drafts or "1,2,3,4").split(",")]
    data = {"prompts": len(prompts), "max_tokens": args.tokens, "repeats": args.repeats, "sizes": sizes, "pairs": {}}
    for name, (target_dir, draft_dir, hf_dir) in pairs.items():
        if args.pairs and name.split()[0] not in args.pairs.split(","):
            continue
        models, worker = Models(load_model(target_dir), load_model(draft_dir)), HFWorker(hf_dir)

        def one_pass(batch: list) -> dict:
            runs = {}
            for size in sizes:
                started = time.perf_counter()
                for first in range(0, len(batch), size):  # both models' encoding: the floor under a run
                    encode_for([models.target, models.draft], batch[first : first + size])
                runs[f"encoding {size}"] = (time.perf_counter() - started, None)
                for k in num_drafts:
                    tokens, _, seconds = decode(models, batch, Settings(max_tokens=args.tokens, num_draft=k), size)
                    runs[f"speculative {k} {size}"] = (seconds, tokens)
                tokens, _, seconds = decode(models, batch, Settings(max_tokens=args.tokens, speculative=False), size)
                runs[f"regular {size}"] = (seconds, tokens)
                result = worker.run_batched(batch, args.tokens, size)
                runs[f"transformers {size}"] = (result["seconds"], result["tokens"])
            return runs

        one_pass(prompts[: max(sizes)])  # warm-up: kernels, allocator pools, every batch shape once
        passes = [one_pass(prompts) for _ in range(args.repeats)]
        worker.close()
        reference = passes[-1][f"regular {sizes[0]}"][1]
        data["pairs"][name] = {
            "generated": sum(map(len, reference)),
            "same_tokens": all(p[key][1] == reference for p in passes for key in p if not key.startswith("encoding")),
            "seconds": {key: statistics.median(p[key][0] for p in passes) for key in passes[0]}}
    data["num_drafts"] = num_drafts
    return data


def render_batch(data: dict) -> str:
    text = (f"{data['prompts']} prompts (the held-out demo prompts, again from the first), at most {data['max_tokens']} "
            f"tokens each, greedy, delta 0; tokens a second over all prompts, encoding included; medians of "
            f"{data['repeats']} passes, runs alternating within a pass. Ceiling: transformers' run over our encoding "
            f"alone, the ratio speculative decoding would reach if decoding took no time.")
    for name, pair in data["pairs"].items():
        seconds = pair["seconds"]
        rate = {key: pair["generated"] / value for key, value in seconds.items()}
        best = {size: max(data["num_drafts"], key=lambda k: rate[f"speculative {k} {size}"]) for size in data["sizes"]}
        unbatched = rate.get(f"speculative {best.get(1)} 1")
        rows = []
        for size in data["sizes"]:
            spec = rate[f"speculative {best[size]} {size}"]
            rows.append([size, f"{spec:.1f} ({best[size]})", f"{rate[f'regular {size}']:.1f}",
                         f"{rate[f'transformers {size}']:.1f}",
                         ratio(spec, unbatched) if unbatched else "-", ratio(spec, rate[f"transformers {size}"]),
                         f"{seconds[f'encoding {size}'] / seconds[f'speculative {best[size]} {size}']:.0%}",
                         ratio(seconds[f"transformers {size}"], seconds[f"encoding {size}"])])
        text += (f"\n\n{name}: {pair['generated']} tokens; every run's tokens equal regular decoding's: "
                 f"{'yes' if pair['same_tokens'] else 'NO'}\n\n"
                 + table(["batch size", "speculative (best num-draft)", "regular", "transformers", "over unbatched speculative",
                          "speculative over transformers", "encoding's share", "ceiling"], rows))
    return text
