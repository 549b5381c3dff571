"""Decoding one prompt at a time: `regular` (T5-large shapes), `steps` (where a decode step's time goes, by
shape) and `speculative` (the benchmark pair)."""

import statistics
import tempfile
import time

from bench import fixtures
from bench.fixtures import DEMO, PAIR, PROMPT_IDS
from bench.harness import alternate, decode, ours_run, ratio, same_tokens, table, warm_up_note, worker_run
from bench.references import HFWorker, ct2_workers


# ---------------------------------------------------------------- regular


def run_regular(args) -> dict:
    """Regular greedy decoding of a forced length on T5-large shapes: ours
    against transformers and CTranslate2 (float32 and int8, with its wheel's
    OpenMP runtime and with Intel's), alternating, and how near the memory
    bandwidth ours reads the weights."""
    from loading import Models, load_model
    from options import Settings

    hf_dir = fixtures.build_large(args.dir / "t5-large-random")
    mlx_dir = args.dir / "t5-large-random-mlx"
    started = time.perf_counter()
    convert_peak = fixtures.convert_measuring_memory(hf_dir, mlx_dir)
    convert_seconds = time.perf_counter() - started
    started = time.perf_counter()
    model = load_model(mlx_dir, one_row=True)  # regular decoding of one prompt, as main.py --regular-decode loads it
    load_seconds = time.perf_counter() - started
    hf, ct2 = HFWorker(hf_dir), ct2_workers(hf_dir, args.dir)
    timings = alternate(against_references(model, hf, ct2, PROMPT_IDS, args.tokens), args.repeats)
    # Forced lengths hide an EOS (ours emits it, the references suppress it): CTranslate2 is checked to EOS.
    to_eos, _, _ = decode(Models(model), [PROMPT_IDS], Settings(max_tokens=args.tokens, speculative=False))
    differ = same_tokens(to_eos, {n: w for n, w in ct2.items() if "int8" not in n}, [PROMPT_IDS], args.tokens)
    differ["transformers"] = int(timings["transformers"].output["tokens"] != timings["ours"].output["tokens"])
    versions = {name: worker.version for name, worker in ({"transformers": hf} | ct2).items()}
    for worker in (hf, *ct2.values()):
        worker.close()
    return {"tokens": args.tokens, "repeats": args.repeats, "versions": versions,
            "tokens_per_second": {name: args.tokens / timing.median for name, timing in timings.items()},
            "warm_ups": {name: timing.warm_ups for name, timing in timings.items()},
            "prompts_differing": differ, "weight_bytes_per_token": fixtures.weight_bytes_per_token(model),
            "read_bandwidth": fixtures.memory_read_bandwidth(), "load_seconds": load_seconds,
            "convert_seconds": convert_seconds, "convert_peak_bytes": convert_peak,
            "checkpoint_bytes": sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))}


def against_references(model, hf, ct2: dict, prompt: list[int], tokens: int) -> dict:
    """Runs of ours and of each reference (transformers, CTranslate2's), each
    decoding the same forced number of greedy tokens from the prompt."""
    from loading import Models
    from options import Settings

    forced = Settings(max_tokens=tokens, speculative=False, ignore_eos=True)
    runs = {"ours": ours_run(Models(model), [prompt], forced), "transformers": worker_run(hf, [prompt], tokens, forced=True)}
    return runs | {name: worker_run(worker, [prompt], tokens, forced=True) for name, worker in ct2.items()}


def render_regular(data: dict) -> str:
    rate, ours = data["tokens_per_second"], data["tokens_per_second"]["ours"]
    rows = [[name, data["versions"].get(name, ""), f"{value:.2f}", ratio(ours, value),
             "" if "int8" in name or name == "ours" else "yes" if not data["prompts_differing"][name] else "NO"]
            for name, value in rate.items()]
    achieved = data["weight_bytes_per_token"] * ours
    return (f"T5-large shapes (random, float32, {data['checkpoint_bytes'] / 1e9:.2f} GB), {data['tokens']} greedy tokens, "
            f"medians of {data['repeats']} alternating runs\n\n"
            + table(["decoding", "version", "tokens/s", "ours over it", "same tokens as ours"], rows)
            + f"\n\nOurs reads {data['weight_bytes_per_token'] / 1e9:.2f} GB of weights a token: {achieved / 1e9:.1f} GB/s, "
            f"{achieved / data['read_bandwidth']:.0%} of what the machine reads summing an array on every core "
            f"({data['read_bandwidth'] / 1e9:.1f} GB/s). Converting took {data['convert_seconds']:.1f} s at "
            f"{data['convert_peak_bytes'] / 1e6:.0f} MB peak; opening the converted model {data['load_seconds']:.2f} s."
            + warm_up_note(data.get("warm_ups")))


# ---------------------------------------------------------------- steps


def step_seconds(model, width: int = 1, steps: int = 20) -> float:
    """Median time of one decode step over `width` new tokens with a warm cache."""
    import mlx.core as mx

    cache = model.make_cache(model.encode(mx.array([PROMPT_IDS])))
    mx.eval(model.decode(mx.array([[0] * 20]), cache))
    tokens = mx.array([[0] * width])
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        mx.eval(model.decode(tokens, cache))
        times.append(time.perf_counter() - start)
        cache.trim(width)
    return statistics.median(times[3:])


def graph_size(*outputs) -> int:
    """Operations in the graph that computes outputs (as MLX will run them)."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return dot.read().count("shape=rectangle")


def seconds_per_op(count: int = 1000) -> float:
    """MLX's cost to run one operation, from a chain of tiny ones built beforehand."""
    import mlx.core as mx

    x, one = mx.zeros((1, 256)), mx.array(1.0)
    mx.eval(x, one)
    times = []
    for _ in range(20):
        y = x
        for _ in range(count):
            y = y + one
        start = time.perf_counter()
        mx.eval(y)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / count


def step_profile(model, steps: int = 30) -> dict:
    """One decode step of one token with a warm cache: the Python time to
    build its graph, the whole step, and its operations."""
    import mlx.core as mx

    cache = model.make_cache(model.encode(mx.array([PROMPT_IDS])))
    mx.eval(model.decode(mx.array([[0] * 20]), cache))
    tokens = mx.array([[0]])
    builds, totals = [], []
    for _ in range(steps + 3):
        start = time.perf_counter()
        logits = model.decode(tokens, cache)
        built = time.perf_counter()
        mx.eval(logits)
        builds.append(built - start)
        totals.append(time.perf_counter() - start)
        cache.trim(1)
    return {"build": statistics.median(builds[3:]), "step": statistics.median(totals[3:]),
            "operations": graph_size(model.decode(tokens, cache))}


def draft_round_seconds(draft, k: int, rounds: int = 30) -> float:
    """A round's drafting of k tokens, as the draft model proposes them (no host sync between steps)."""
    import mlx.core as mx

    from rows import Request, Row, encode_for
    from drafting import DraftModel
    from sampling import RowSampling, Sampling

    (cache,) = encode_for([draft], [PROMPT_IDS])
    mx.eval(draft.decode(mx.array([[0] * 20]), cache))
    drafter, times = DraftModel(draft), []
    for _ in range(rounds + 3):
        row = Row(Request(PROMPT_IDS), (0.0, 0.0), (0, 0))
        drafter.start(row, (draft.args.decoder_start_token_id,))
        start = time.perf_counter()
        proposal = drafter.propose([row], [k], RowSampling([Sampling()]), None, cache)
        mx.eval(proposal.drafts, proposal.logits)
        times.append(time.perf_counter() - start)
        cache.trim(k)
    return statistics.median(times[3:])


def step_shapes(root) -> dict:
    pair = fixtures.benchmark_pair(root)
    return {
        "demo": ("the demo target: d_model 256, 6+6 layers, 8 M", pair["draft_hf"], DEMO / "target"),
        "small": ("T5-small shapes (random): d_model 512, 6+6 layers, 60 M",
                  fixtures.build_large(root / "t5-small-random", fixtures.T5_SMALL), root / "t5-small-random-mlx"),
        "deep": ("the benchmark pair's target: d_model 256, 24+24 layers, 220 M", pair["target_hf"], pair["target"]),
        "large": ("T5-large shapes (random): d_model 1024, 24+24 layers, 740 M", fixtures.build_large(root / "t5-large-random"),
                  root / "t5-large-random-mlx"),
    }


def run_steps(args) -> dict:
    """Regular decoding on narrow, deep and wide shapes against transformers
    and CTranslate2, compiled steps (the default) against steps built op by
    op, each step split into Python graph building, MLX's per-operation
    dispatch and compute; and the draft's step at num-draft 1-8."""
    from loading import Models, load_model
    from options import Settings

    shapes, data = step_shapes(args.dir), {"tokens": args.tokens, "repeats": args.repeats, "shapes": {}}
    data["seconds_per_op"] = seconds_per_op()
    forced = Settings(max_tokens=args.tokens, speculative=False, ignore_eos=True)
    for name in args.shapes.split(",") if args.shapes else list(shapes):
        label, hf_dir, mlx_dir = shapes[name]
        model = load_model(fixtures.converted(hf_dir, mlx_dir), one_row=True)  # as main.py --regular-decode loads it
        hf, ct2 = HFWorker(hf_dir), ct2_workers(hf_dir, args.dir)

        def ours(compiled: bool, run=ours_run(Models(model), [PROMPT_IDS], forced)):
            model.compiled = compiled
            return run()

        runs = {"ours compiled": lambda: ours(True), "ours op by op": lambda: ours(False),
                "transformers": worker_run(hf, [PROMPT_IDS], args.tokens, forced=True)}
        runs |= {key: worker_run(worker, [PROMPT_IDS], args.tokens, forced=True) for key, worker in ct2.items()}
        timings = alternate(runs, args.repeats)
        model.compiled = True
        to_eos, _, _ = decode(Models(model), [PROMPT_IDS], Settings(max_tokens=args.tokens, speculative=False))
        differ = same_tokens(to_eos, {k: w for k, w in ct2.items() if "int8" not in k}, [PROMPT_IDS], args.tokens)
        for worker in (hf, *ct2.values()):
            worker.close()
        profiles = {}
        for compiled in (True, False):
            model.compiled = compiled
            profiles["compiled" if compiled else "op by op"] = step_profile(model)
        model.compiled = True
        data["shapes"][name] = {"label": label, "prompts_differing": differ, "profiles": profiles,
                                "tokens_per_second": {k: args.tokens / t.median for k, t in timings.items()}}
    if "demo" in data["shapes"]:
        draft = load_model(DEMO / "target")
        data["draft_ms_per_token"] = {}
        for compiled in (True, False):
            draft.compiled = compiled
            data["draft_ms_per_token"]["compiled" if compiled else "op by op"] = [
                draft_round_seconds(draft, k) / k * 1e3 for k in range(1, 9)]
    return data


def runtime(ct2: str) -> str:
    return ct2.removeprefix("CTranslate2 fp32").strip(", ") or "as installed"


def render_steps(data: dict) -> str:
    per_op, rows = data["seconds_per_op"], []
    for shape in data["shapes"].values():
        rate = shape["tokens_per_second"]
        ct2 = [key for key in rate if key.startswith("CTranslate2 fp32")]
        for key in ("compiled", "op by op"):
            p = shape["profiles"][key]
            compute = max(0.0, p["step"] - p["build"] - p["operations"] * per_op)
            rows.append([shape["label"] if key == "compiled" else "", key, f"{rate['ours ' + key]:.1f}",
                         ratio(rate["ours " + key], rate["transformers"]),
                         "; ".join(f"{ratio(rate['ours ' + key], rate[c])} {runtime(c)}" for c in ct2),
                         f"{p['step'] * 1e3:.2f} ms: Python {p['build'] * 1e3:.2f}, {p['operations']} ops, "
                         f"compute ~{compute * 1e3:.2f}"])
    text = (f"Regular greedy decoding, {data['tokens']} tokens, medians of {data['repeats']} alternating runs; a step's "
            f"time split (medians of 30 steps; MLX runs an operation in {per_op * 1e6:.1f} us)\n\n"
            + table(["shape", "ours", "tokens/s", "over transformers", "over CTranslate2 fp32", "a step"], rows))
    differing = {k: v for shape in data["shapes"].values() for k, v in shape["prompts_differing"].items() if v}
    text += f"\n\nCTranslate2's float32 greedy tokens to EOS equal ours: {'yes' if not differing else 'NO: ' + str(differing)}."
    if "draft_ms_per_token" in data:
        cells = {key: " / ".join(f"{ms:.2f}" for ms in values) for key, values in data["draft_ms_per_token"].items()}
        text += (f" The demo target as a draft, ms a drafted token at num-draft 1-8: {cells['compiled']} compiled, "
                 f"{cells['op by op']} op by op.")
    return text


# ---------------------------------------------------------------- speculative


def run_speculative(args) -> dict:
    """The benchmark pair on held-out demo prompts, each contender over every
    prompt a pass, alternating: ours regular, speculative at --num-draft and
    auto (what auto learns kept through the passes, as a session keeps it);
    transformers regular and assisted (as installed, and with its cache fixed,
    references.hf_worker); CTranslate2 regular, float32 and int8."""
    from loading import Models, load_model, load_tokenizer
    from options import Settings

    pair = fixtures.benchmark_pair(args.dir)
    target, draft = load_model(pair["target"]), load_model(pair["draft"])
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(text) for text in fixtures.held_out_prompts(args.prompts or 6)]
    workers = {"transformers": HFWorker(pair["target_hf"]),
               "transformers assisted": HFWorker(pair["target_hf"], pair["draft_hf"], args.num_draft),
               "transformers assisted, cache fixed": HFWorker(pair["target_hf"], pair["draft_hf"], args.num_draft,
                                                               cache_fix=True)}
    ct2 = ct2_workers(pair["target_hf"], args.dir)
    models = Models(target, draft)
    settings = {"ours regular": Settings(max_tokens=args.tokens, speculative=False),
                f"ours num-draft {args.num_draft}": Settings(max_tokens=args.tokens, num_draft=args.num_draft),
                "ours num-draft auto": Settings(max_tokens=args.tokens, num_draft="auto")}
    runs = {name: ours_run(models, prompts, s) for name, s in settings.items()}
    runs |= {name: worker_run(worker, prompts, args.tokens) for name, worker in (workers | ct2).items()}
    timings = alternate(runs, args.repeats)
    versions = {name: worker.version for name, worker in (workers | ct2).items()}
    for worker in (*workers.values(), *ct2.values()):
        worker.close()
    reference = timings["ours regular"].output["tokens"]
    drafts_own, _, _ = decode(Models(draft), prompts, Settings(max_tokens=args.tokens, speculative=False))
    contenders = {name: {"tokens_per_second": sum(map(len, timing.output["tokens"])) / timing.median,
                         "same_tokens": sum(a == b for a, b in zip(timing.output["tokens"], reference)),
                         "drafted": timing.output["drafted"], "accepted": timing.output["accepted"]}
                  for name, timing in timings.items()}
    t_target = step_seconds(target)
    return {"prompts": len(prompts), "tokens": sum(map(len, reference)), "max_tokens": args.tokens,
            "num_draft": args.num_draft, "repeats": args.repeats, "pair": PAIR, "versions": versions,
            "contenders": contenders, "warm_ups": {name: timing.warm_ups for name, timing in timings.items()},
            "target_step": t_target, "draft_step": step_seconds(draft),
            "verify_over_step": step_seconds(target, args.num_draft + 1) / t_target,
            "prompts_where_the_draft_differs": sum(a != b for a, b in zip(drafts_own, reference))}


def render_speculative(data: dict) -> str:
    contenders = data["contenders"]
    auto = contenders["ours num-draft auto"]["tokens_per_second"]
    rows = []
    for name, c in contenders.items():
        accepted = f"{c['accepted'] / c['drafted']:.2f}" if c.get("drafted") else ""
        same = f"{c['same_tokens']} of {data['prompts']}"
        rows.append([name, data["versions"].get(name, ""), f"{c['tokens_per_second']:.2f}", accepted, same,
                     ratio(auto, c["tokens_per_second"])])
    return (f"The benchmark pair (draft: the demo target; target: it and {PAIR['extra_layers']}+{PAIR['extra_layers']} random "
            f"layers, d_ff {PAIR['d_ff']}, float32), {data['prompts']} held-out demo prompts ({data['tokens']} tokens), greedy, "
            f"delta 0, medians of {data['repeats']} alternating passes\n\n"
            + table(["decoding", "version", "tokens/s", "acceptance", "prompts with ours' regular tokens",
                     "ours auto over it"], rows)
            + f"\n\nA target step {data['target_step'] * 1e3:.1f} ms, a draft step {data['draft_step'] * 1e3:.1f} ms; the "
            f"verify pass of {data['num_draft'] + 1} tokens costs {data['verify_over_step']:.2f} target steps. The draft's "
            f"own greedy output differs from the target's on {data['prompts_where_the_draft_differs']} of "
            f"{data['prompts']} prompts." + warm_up_note(data.get("warm_ups")))


# ---------------------------------------------------------------- families


def run_families(args) -> dict:
    """Regular greedy decoding of a forced length on the BART family's
    shapes (BART-large, NLLB-600M; random, float32): ours against
    transformers and CTranslate2 (float32 and int8), alternating, and
    whether each reference's greedy tokens to EOS equal ours."""
    from mlx.utils import tree_flatten

    from loading import Models, load_model
    from options import Settings

    prompt = [0] + PROMPT_IDS[:-1] + [2]  # the BART family's: <s> ... </s>
    data = {"tokens": args.tokens, "repeats": args.repeats, "shapes": {}}
    for label, shapes, name in (("BART-large", fixtures.BART_LARGE, "bart-large-random"),
                                ("NLLB-200-distilled-600M", fixtures.NLLB_600M, "nllb-600m-random")):
        hf_dir = fixtures.build_family(args.dir / name, shapes)
        model = load_model(fixtures.converted(hf_dir, args.dir / f"{name}-mlx"), one_row=True)
        hf = HFWorker(hf_dir)
        ct2 = {key: worker for key, worker in ct2_workers(hf_dir, args.dir).items() if "Intel" not in key}
        timings = alternate(against_references(model, hf, ct2, prompt, args.tokens), args.repeats)
        # To EOS, every reference: a forced length differs where EOS would win (min_new_tokens masks it, ignore_eos not).
        to_eos, _, _ = decode(Models(model), [prompt], Settings(max_tokens=args.tokens, speculative=False))
        references = {"transformers": hf} | {k: w for k, w in ct2.items() if "int8" not in k}
        differ = same_tokens(to_eos, references, [prompt], args.tokens)
        versions = {key: worker.version for key, worker in ({"transformers": hf} | ct2).items()}
        for worker in (hf, *ct2.values()):
            worker.close()
        data["shapes"][label] = {"versions": versions, "prompts_differing": differ,
                                 "parameters": sum(v.size for _, v in tree_flatten(model.parameters())),
                                 "tokens_per_second": {k: args.tokens / t.median for k, t in timings.items()}}
    return data


def render_families(data: dict) -> str:
    rows = []
    for label, shape in data["shapes"].items():
        rate, ours = shape["tokens_per_second"], shape["tokens_per_second"]["ours"]
        for name, value in rate.items():
            same = "" if "int8" in name or name == "ours" else "yes" if not shape["prompts_differing"][name] else "NO"
            rows.append([f"{label} ({shape['parameters'] / 1e6:,.0f} M)" if name == "ours" else "", name,
                         shape["versions"].get(name, ""), f"{value:.2f}", ratio(ours, value), same])
    return (f"The BART family's shapes (random, float32), {data['tokens']} greedy tokens, medians of {data['repeats']} "
            "alternating runs\n\n" + table(["shape", "decoding", "version", "tokens/s", "ours over it",
                                              "same tokens as ours"], rows))
