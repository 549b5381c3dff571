"""Drafting without tuning: `drafting` (num-draft auto against each fixed num-draft), `fresh` (what a new
process sees) and `lookup` (prompt lookup, no draft model)."""

import json
import subprocess
import sys

from bench import fixtures
from bench.fixtures import DEMO
from bench.harness import ROOT, alternate, decode, median, ratio, table


def compare_runs(prompts: list, runs: dict, repeats: int) -> dict:
    """Every run over every prompt, alternating prompt by prompt, repeats
    times: {name: (tokens/s median, {drafted, accepted, rounds}, outputs of the last pass)}.
    run(prompt) -> (seconds, {tokens, drafted, accepted}) as harness.ours_run's."""
    for prompt in prompts[:3]:  # warm-up: kernels and traces of each run's shapes
        for run in runs.values():
            run(prompt)
    passes = []
    for _ in range(repeats):
        totals = {name: {"seconds": 0.0, "generated": 0, "drafted": 0, "accepted": 0, "tokens": []} for name in runs}
        for prompt in prompts:
            for name, run in runs.items():
                seconds, output = run(prompt)
                total = totals[name]
                total["seconds"] += seconds
                total["generated"] += sum(map(len, output["tokens"]))
                total["drafted"] += output["drafted"]
                total["accepted"] += output["accepted"]
                total["tokens"] += output["tokens"]
        passes.append(totals)
    return {name: {"tokens_per_second": median(p[name]["generated"] / p[name]["seconds"] for p in passes),
                   "acceptance": sum(p[name]["accepted"] for p in passes) / max(1, sum(p[name]["drafted"] for p in passes)),
                   "tokens": passes[-1][name]["tokens"]} for name in runs}


def prompt_runs(models, settings: dict):
    """{name: run(prompt)} over one prompt each, for compare_runs: the whole
    call's seconds (from the prompt's join to the last round's end)."""
    def run(prompt, settings):
        tokens, stats, seconds = decode(models, [prompt], settings)
        return seconds, {"tokens": tokens, "drafted": stats[0].drafted, "accepted": stats[0].accepted}

    return {name: (lambda prompt, s=s: run(prompt, s)) for name, s in settings.items()}


# ---------------------------------------------------------------- drafting


def run_drafting(args) -> dict:
    """num-draft auto against every fixed num-draft, on both pairs: greedy,
    one prompt at a time, the settings alternating prompt by prompt; auto
    keeps what it learnt from one prompt to the next, as loading.Models does
    in a session."""
    from loading import Models, load_model, load_tokenizer
    from options import Settings

    pair = fixtures.benchmark_pair(args.dir)
    loaded = {"demo target": load_model(DEMO / "target"), "demo draft": load_model(DEMO / "draft"),
              "benchmark target": load_model(pair["target"])}
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(text) for text in fixtures.held_out_prompts()][: args.prompts]
    fixed = [int(k) for k in (args.num_drafts or "1,2,3,4,5,6,8").split(",")]
    cases = [("demo pair", "demo target", "demo draft", 0.0), ("demo pair", "demo target", "demo draft", 0.5),
             ("benchmark pair", "benchmark target", "demo target", 0.0)]
    data = {"prompts": len(prompts), "max_tokens": args.tokens, "repeats": args.repeats, "cases": []}
    for pair_name, target, draft, delta in cases:
        if args.pairs and pair_name.split()[0] not in args.pairs.split(","):
            continue
        models = Models(loaded[target], loaded[draft])
        settings = {str(k): Settings(max_tokens=args.tokens, num_draft=k, delta=delta) for k in fixed}
        settings["auto"] = Settings(max_tokens=args.tokens, num_draft="auto", delta=delta)
        results = compare_runs(prompts, prompt_runs(models, settings), args.repeats)
        same = all(r["tokens"] == results[str(fixed[0])]["tokens"] for r in results.values())
        data["cases"].append({"pair": pair_name, "target": target, "draft": draft, "delta": delta, "same_tokens": same,
                              "results": {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}})
    return data


def render_drafting(data: dict) -> str:
    if not data["cases"]:
        return "No pair was measured (--pairs named none)."
    columns = ["pair", "delta"] + [f"num-draft {k}" for k in next(iter(data["cases"]))["results"] if k != "auto"] + \
        ["auto", "auto / best fixed", "every run's tokens the same"]
    rows = []
    for case in data["cases"]:
        results = case["results"]
        best = max((k for k in results if k != "auto"), key=lambda k: results[k]["tokens_per_second"])
        cells = [f"**{r['tokens_per_second']:.1f}**" if k == best else f"{r['tokens_per_second']:.1f}"
                 for k, r in results.items() if k != "auto"]
        rows.append([case["pair"], case["delta"], *cells, f"{results['auto']['tokens_per_second']:.1f}",
                     f"{results['auto']['tokens_per_second'] / results[best]['tokens_per_second']:.1%}",
                     ("yes" if case["same_tokens"] else "NO") if case["delta"] == 0 else "-"])
    return (f"Tokens a second (encoding included), greedy, {data['prompts']} held-out demo prompts, at most "
            f"{data['max_tokens']} tokens each, one prompt at a time, the settings alternating prompt by prompt; "
            f"medians of {data['repeats']} passes; the best fixed num-draft in bold\n\n"
            + table(columns, rows))


# ---------------------------------------------------------------- fresh


def main_py(*options: str) -> list[dict]:
    """main.py --json in a fresh process: one result (text, tokens, stats) per prompt."""
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), "--json", *options], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"main.py {' '.join(options)} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run_fresh(args) -> dict:
    """What a fresh process sees, where nothing is traced yet and auto has
    learnt nothing: a short session (the 20 held-out demo prompts through
    main.py --prompts-file, demo pair) under each fixed num-draft and auto;
    and one-shot runs of the benchmark pair (main.py --prompt, one prompt a
    process) against the same prompts warm (a second pass in one process)."""
    session = ["--demo", "--prompts-file", str(DEMO / "prompts.txt"), "--batch-size", "1", "--max-tokens", "40",
               "--delta", "0"]

    def short(num_draft: str):
        def run():
            results = main_py(*session, "--num-draft", num_draft)
            return sum(r["stats"]["seconds"] for r in results), [r["tokens"] for r in results]
        return run

    fixed = (args.num_drafts or "1,2,3,4").split(",")
    timings = alternate({k: short(k) for k in [*fixed, "auto"]}, args.repeats)
    data = {"repeats": args.repeats, "max_tokens": args.tokens,
            "session": {k: {"seconds": t.median, "runs": t.seconds} for k, t in timings.items()},
            "session_same_tokens": all(t.output == timings[fixed[0]].output for t in timings.values()), "one_shot": {}}
    pair = fixtures.benchmark_pair(args.dir)
    flags = ["--model", str(pair["target"]), "--draft-model", str(pair["draft"]), "--delta", "0",
             "--max-tokens", str(args.tokens)]
    prompts = fixtures.held_out_prompts(args.prompts or 6)
    listed = args.dir / "fresh-prompts.txt"
    listed.write_text("\n".join(prompts * 2) + "\n")
    for num_draft in [str(args.num_draft), "auto"]:
        def one_shot():
            results = [main_py(*flags, "--num-draft", num_draft, "--prompt", prompt)[0] for prompt in prompts]
            return sum(r["stats"]["seconds"] for r in results), [r["tokens"] for r in results]

        def warm():
            second = main_py(*flags, "--num-draft", num_draft, "--prompts-file", str(listed), "--batch-size", "1")[len(prompts):]
            return sum(r["stats"]["seconds"] for r in second), [r["tokens"] for r in second]

        runs = alternate({"one-shot": one_shot, "warm": warm}, args.repeats)
        assert runs["one-shot"].output == runs["warm"].output, "one-shot and warm runs must give the same tokens"
        tokens = sum(map(len, runs["warm"].output))
        data["one_shot"][num_draft] = {name: tokens / timing.median for name, timing in runs.items()}
    data["prompts"] = len(prompts)
    return data


def render_fresh(data: dict) -> str:
    session = data["session"]
    fixed = [k for k in session if k != "auto"]
    best = min(fixed, key=lambda k: session[k]["seconds"])
    rows = [[f"**{k}**" if k == best else k, f"{s['seconds']:.3f}", " ".join(f"{x:.2f}" for x in s["runs"])]
            for k, s in session.items()]
    one_shot = [[k, f"{r['one-shot']:.1f}", f"{r['warm']:.1f}", f"{r['one-shot'] / r['warm']:.0%}"]
                for k, r in data["one_shot"].items()]
    return ("A short session in a fresh process: `main.py --demo --prompts-file demo/prompts.txt --batch-size 1 "
            f"--max-tokens 40 --delta 0`, seconds over the 20 prompts (encoding and decoding), medians of "
            f"{data['repeats']} alternating runs after a warm-up run each; the best fixed num-draft in bold\n\n"
            + table(["num-draft", "seconds", "runs"], rows)
            + f"\n\nauto / best fixed (speed): {session[best]['seconds'] / session['auto']['seconds']:.1%}; every run's "
            f"tokens the same: {'yes' if data['session_same_tokens'] else 'NO'}\n\n"
            f"The benchmark pair, one-shot (`main.py --prompt`, a process a prompt) against warm (the prompts' second "
            f"pass in one process), {data['prompts']} held-out demo prompts, delta 0, at most {data['max_tokens']} tokens, "
            f"tokens a second (loading apart)\n\n" + table(["num-draft", "one-shot", "warm", "one-shot / warm"], one_shot))


# ---------------------------------------------------------------- lookup


def run_lookup(args) -> dict:
    """Prompt lookup against regular decoding, on both targets, over the
    held-out demo prompts and copy-heavy ones (fixtures.copy_prompts)."""
    from loading import Models, load_model, load_tokenizer
    from options import Settings

    pair = fixtures.benchmark_pair(args.dir)
    targets = {"demo target": load_model(DEMO / "target"), "benchmark target": load_model(pair["target"])}
    tokenizer = load_tokenizer(DEMO / "target")
    sets = {"held-out demo": [tokenizer.encode(text) for text in fixtures.held_out_prompts()][: args.prompts],
            "copy-heavy": fixtures.copy_prompts(targets["demo target"], args.prompts or 20)}
    longest = [2, 4, 8]
    data = {"max_tokens": args.tokens, "repeats": args.repeats, "longest": longest, "rows": []}
    for target_name, target in targets.items():
        if args.pairs and target_name.split()[0] not in args.pairs.split(","):
            continue
        settings = {"regular": Settings(max_tokens=args.tokens, speculative=False)}
        settings |= {str(k): Settings(max_tokens=args.tokens, num_draft=k, prompt_lookup=True) for k in longest}
        for prompts_name, prompts in sets.items():
            results = compare_runs(prompts, prompt_runs(Models(target), settings), args.repeats)
            same = all(r["tokens"] == results["regular"]["tokens"] for r in results.values())
            data["rows"].append({"target": target_name, "prompts": f"{prompts_name} ({len(prompts)})", "same_tokens": same,
                                 "results": {k: {"tokens_per_second": r["tokens_per_second"], "acceptance": r["acceptance"]}
                                             for k, r in results.items()}})
    return data


def render_lookup(data: dict) -> str:
    rows = []
    for row in data["rows"]:
        regular = row["results"]["regular"]["tokens_per_second"]
        cells = [f"{r['tokens_per_second']:.1f}, {r['acceptance']:.2f}, {ratio(r['tokens_per_second'], regular)}"
                 for k, r in row["results"].items() if k != "regular"]
        rows.append([row["target"], row["prompts"], f"{regular:.1f}", *cells, "yes" if row["same_tokens"] else "NO"])
    return (f"Prompt lookup (no draft model) against regular decoding: greedy, delta 0, at most {data['max_tokens']} "
            f"tokens a prompt, runs alternating prompt by prompt, medians of {data['repeats']} passes\n\n"
            + table(["target", "prompts", "regular tokens/s"]
                    + [f"lookup {k}: tokens/s, acceptance, speedup" for k in data["longest"]] + ["same tokens as regular"], rows))
