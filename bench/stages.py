"""`stages`: the benchmark pair's target split over 1, 2 and 3 ranks of this machine (pipeline.py, MLX's ring
backend over 127.0.0.1, the ranks started as mlx.launch starts them: pipeline.local_ranks), regular and drafted:
tokens a second and each rank's memory; then a model on paper of what a link between Macs adds, and what that
leaves for T5-11B drafted by T5-small on two 16 GB Macs."""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pipeline

from bench import fixtures, memory
from bench.harness import ROOT, table

RANKS = (1, 2, 3)
# The model on paper's assumptions (each named where it is shown): a base M2/M3's memory bandwidth (Apple's
# figure), and a hop between Macs: TCP's fixed cost a message plus the bytes at the link's usable rate.
MAC_BANDWIDTH = 100e9  # bytes a second
LINKS = {"Thunderbolt (TCP over its IP link)": dict(latency=100e-6, rate=2.5e9),
         "10 GbE": dict(latency=150e-6, rate=1.1e9)}
STEP_FLOOR = 3e-3  # seconds: the least a decode step takes in MLX, however small the model (T5-small's is this)
ACCEPTANCES = (0.6, 0.7, 0.8)  # a draft token's chance of being the target's (T5-small's for T5-11B is not measured here)
NUM_DRAFT = 4


def stages_worker(spec: str) -> None:
    """On every rank of one run: load the pair with the target in `ranks` stages; on rank 0, decode the prompts
    regular and drafted, alternating, and print the tokens a second, the acceptance and each rank's memory."""
    import time

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from generate import batch_generate
    from loading import load

    spec = json.loads(spec)
    models = load(spec["target"], draft=spec["draft"], stages=spec["ranks"] if spec["ranks"] > 1 else None)
    modes = {"regular": dict(speculative=False), f"num-draft {spec['num_draft']}": dict(num_draft=spec["num_draft"])}
    seconds, tokens, accepted = {mode: [] for mode in modes}, {}, {}
    for repeat in range(spec["repeats"] + 1):  # the first warms up
        for mode, options in modes.items():
            started = time.perf_counter()
            done = batch_generate(models, spec["prompts"], batch_size=1, max_tokens=spec["tokens"], **options)
            if repeat:
                seconds[mode].append(time.perf_counter() - started)
            tokens[mode] = [g.tokens for g in done]
            drafted = sum(g.stats.drafted for g in done)
            accepted[mode] = sum(g.stats.accepted for g in done) / drafted if drafted else None
    ranks = models.target.memory() if spec["ranks"] > 1 else \
        [{"weights": sum(a.nbytes for _, a in tree_flatten(models.target.parameters())), "peak": mx.get_peak_memory()}]
    print(json.dumps({"tokens_per_second": {mode: sum(map(len, tokens[mode])) / statistics.median(seconds[mode])
                                            for mode in modes},
                      "same_tokens": tokens["regular"] == list(tokens.values())[1], "acceptance": accepted,
                      "ranks": ranks}), flush=True)


def run_stages(args) -> dict:
    pair = fixtures.benchmark_pair(args.dir)
    prompts = fixtures.held_out_prompts(args.prompts or 4)
    runs = {}
    for ranks in RANKS:
        spec = dict(target=str(pair["target"]), draft=str(pair["draft"]), ranks=ranks, prompts=prompts,
                    tokens=args.tokens, num_draft=args.num_draft or NUM_DRAFT, repeats=args.repeats)
        argv = ["-m", "bench", "--stages-worker", json.dumps(spec)]
        if ranks > 1:  # as mlx.launch starts them, without its relay of their output, which keeps a core busy
            with tempfile.TemporaryDirectory() as folder:
                processes = pipeline.local_ranks(ranks, argv, Path(folder))
                outputs = [process.communicate() for process in processes]
            if any(process.returncode for process in processes):
                raise RuntimeError(f"a rank failed: {[err[-1000:] for _, err in outputs]}")
            out = outputs[0][0]
        else:
            out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        runs[ranks] = json.loads(out.strip().splitlines()[-1])
    return {"prompts": len(prompts), "max_tokens": args.tokens, "num_draft": args.num_draft or NUM_DRAFT,
            "repeats": args.repeats, "runs": runs, "on_paper": on_paper()}


def on_paper() -> dict:
    """T5-11B drafted by T5-small, the target split over two 16 GB Macs: a decode step reads the decoder's
    weights (memory-bound), a round adds the link's hops, and drafting makes a round yield more tokens."""
    target, draft = memory.PUBLIC_T5["t5-11b"], memory.PUBLIC_T5["t5-small"]
    d_model, vocabulary = target["d_model"], 32128
    found = {}
    for format in ("bfloat16", "8-bit"):
        weights = memory.weight_bytes(target, format)
        step = max(STEP_FLOOR, memory.weight_bytes(target, format, only=("decoder.", "shared.")) / MAC_BANDWIDTH)
        draft_step = max(STEP_FLOOR, memory.weight_bytes(draft, format, only=("decoder.", "shared.")) / MAC_BANDWIDTH)
        rank_0 = weights / 2 + memory.weight_bytes(draft, format) + memory.RUNTIME_GB * 1e9  # the fuller Mac
        per_format = {"weights_per_mac": weights / 2, "fits": rank_0 <= memory.MAC_WORKING_SET_GIB[16] * 2**30,
                      "one_mac_fits": weights + memory.RUNTIME_GB * 1e9 <= memory.MAC_WORKING_SET_GIB[16] * 2**30,
                      "target_step": step, "draft_step": draft_step, "links": {}}
        for link, figures in LINKS.items():
            def hops(tokens):  # rank 0 -> rank 1: the hidden states; rank 1 -> rank 0: the logits (float16 or 32)
                sent = tokens * d_model * 2, tokens * vocabulary * 4
                return sum(figures["latency"] + size / figures["rate"] for size in sent)
            regular = 1 / (step + hops(1))
            drafted = {}
            for acceptance in ACCEPTANCES:
                per_round = (1 - acceptance ** (NUM_DRAFT + 1)) / (1 - acceptance)  # tokens a round yields
                drafted[acceptance] = per_round / (NUM_DRAFT * draft_step + step + hops(NUM_DRAFT + 1))
            per_format["links"][link] = {"hop_regular": hops(1), "hop_verify": hops(NUM_DRAFT + 1),
                                         "regular": regular, "drafted": drafted}
        found[format] = per_format
    return {"mac_bandwidth": MAC_BANDWIDTH, "links": LINKS, "num_draft": NUM_DRAFT, "step_floor": STEP_FLOOR,
            "runtime_gb": memory.RUNTIME_GB,
            "working_set_gib": memory.MAC_WORKING_SET_GIB[16], "formats": found}


def render_stages(data: dict) -> str:
    rows = []
    for ranks, run in data["runs"].items():
        speeds = run["tokens_per_second"]
        regular, drafted = speeds["regular"], speeds[f"num-draft {data['num_draft']}"]
        acceptance = run["acceptance"][f"num-draft {data['num_draft']}"]
        memory_cells = ", ".join(f"{rank['weights'] / 2**20:.0f} / {rank['peak'] / 2**20:.0f}" for rank in run["ranks"])
        rows.append([ranks, f"{regular:.1f}", f"{drafted:.1f}", f"{acceptance:.2f}", f"{drafted / regular:.2f}x",
                     "yes" if run["same_tokens"] else "no", memory_cells])
    measured = table(["ranks", "regular tokens/s", f"num-draft {data['num_draft']} tokens/s", "drafts accepted",
                      "drafted speedup", "drafted = regular", "each rank's weights / peak (MiB)"], rows)
    paper = data["on_paper"]
    paper_rows = []
    for format, figures in paper["formats"].items():
        for link, speeds in figures["links"].items():
            fits = "yes" if figures["fits"] else "no"
            paper_rows.append([format, f"{figures['weights_per_mac'] / 1e9:.1f} GB ({fits}; on one Mac: "
                               f"{'yes' if figures['one_mac_fits'] else 'no'})", link,
                               f"{speeds['hop_regular'] * 1e3:.2f} / {speeds['hop_verify'] * 1e3:.2f} ms",
                               f"{figures['target_step'] * 1e3:.0f} ms", f"{speeds['regular']:.1f}",
                               " / ".join(f"{speed:.1f}" for speed in speeds["drafted"].values())])
    acceptances = " / ".join(str(a) for a in ACCEPTANCES)
    links = "; ".join(f"{name} {f['latency'] * 1e6:.0f} us and {f['rate'] / 1e9:.1f} GB/s" for name, f in paper["links"].items())
    columns = ["format", "weights a Mac (fits?)", "link", "hops a round (regular / verify)", "target step",
               "regular tokens/s", f"drafted tokens/s at acceptance {acceptances}"]
    return (f"{data['prompts']} held-out demo prompts, at most {data['max_tokens']} tokens each, one at a time, "
            f"medians of {data['repeats']}; the benchmark pair's target split over the ranks of this one machine "
            "(the ring backend over 127.0.0.1: no link's latency is in these figures; the ranks share its cores, and a "
            "rank waiting for another keeps one busy: MLX's ring backend polls its sockets)."
            f"\n\n{measured}\n\n"
            f"On paper: T5-11B split over two 16 GB Macs ({paper['working_set_gib']} GiB of GPU working set each), "
            f"drafted by T5-small on rank 0, num-draft {paper['num_draft']}; a decode step reads the decoder's weights "
            f"at {paper['mac_bandwidth'] / 1e9:.0f} GB/s (a base M2 or M3), and takes at least "
            f"{paper['step_floor'] * 1e3:.0f} ms (T5-small's step is that floor); a hop costs its link's latency plus "
            f"its bytes at the link's rate (assumed: {links}). A Mac fits its share when the weights, the draft and "
            f"{paper['runtime_gb']:g} GB of runtime fit its working set.\n\n" + table(columns, paper_rows))
