"""Decoding controls: what each logits processor costs a decode step (`processors`), and beam search against the
references (`beams`)."""

from bench import fixtures
from bench.fixtures import DEMO
from bench.harness import alternate, decode, ours_run, ratio, table, worker_run
from bench.references import HFWorker, ct2_workers

# The processors measured, each as the options a request gives.
PROCESSORS = {
    "none": {},
    "repetition_penalty 1.2": dict(repetition_penalty=1.2),
    "presence + frequency": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "no_repeat_ngram_size 3": dict(no_repeat_ngram_size=3),
    "logit_bias (2 tokens)": dict(logit_bias={5: -2.0, 7: 1.5}),
    "logprobs 5": dict(logprobs=5),
    "all of them": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5, no_repeat_ngram_size=3,
                        logit_bias={5: -2.0, 7: 1.5}, min_tokens=10, logprobs=5),
}


def stats_run(models, prompts: list[list[int]], settings):
    """A run over the prompts one at a time, for `alternate`: (seconds, the runs' Stats summed)."""
    from options import Stats

    def run():
        stats = [s for prompt in prompts for s in decode(models, [prompt], settings)[1]]
        total = sum(stats, Stats())
        return total.seconds, total
    return run


def run_processors(args) -> dict:
    """Forced lengths (ignore_eos), each processor against none, alternating:
    regular and speculative decoding (--num-draft) on the demo pair and the
    benchmark pair, regular on T5-large shapes (one prompt); then, to EOS, speculative decoding with
    repetition_penalty 1.2 against without on the trained pairs, whose
    acceptance the penalty changes."""
    from loading import Models, load, load_model, load_tokenizer
    from options import Settings

    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(text) for text in fixtures.held_out_prompts(args.prompts or 3)]
    demo = load(DEMO / "target", draft=DEMO / "draft")
    pair = fixtures.benchmark_pair(args.dir)
    benchmark = Models(load_model(pair["target"]), load_model(pair["draft"]))
    large_dir = fixtures.converted(fixtures.build_large(args.dir / "t5-large-random"), args.dir / "t5-large-random-mlx")
    large = Models(load_model(large_dir, one_row=True))
    data = {"tokens": args.tokens, "repeats": args.repeats, "num_draft": args.num_draft, "prompts": len(prompts),
            "shapes": {}}
    for label, models, kinds in (("the demo target (8.4 M parameters)", demo, ("regular", "speculative")),
                                 ("the benchmark pair's target (220 M)", benchmark, ("regular", "speculative")),
                                 ("T5-large shapes (738 M)", large, ("regular",))):
        shape = data["shapes"][label] = {}
        for kind in kinds:
            runs = {name: stats_run(models, prompts[:1] if models is large else prompts,
                                    Settings(max_tokens=args.tokens, ignore_eos=True, speculative=kind == "speculative",
                                             num_draft=args.num_draft, **options))
                    for name, options in PROCESSORS.items()}
            timings = alternate(runs, args.repeats)
            shape[kind] = {name: {"tokens_per_second": t.output.generated / t.median,
                                  "ms_per_round": t.median / t.output.target_calls * 1e3,
                                  "acceptance": t.output.acceptance_rate} for name, t in timings.items()}
    trained = {"demo pair": demo, "benchmark pair": benchmark}
    data["penalized"] = {}
    for label, models in trained.items():
        runs = {name: stats_run(models, prompts, Settings(max_tokens=args.tokens, num_draft=args.num_draft, **options))
                for name, options in (("without", {}), ("repetition_penalty 1.2", dict(repetition_penalty=1.2)))}
        regular = {name: stats_run(models, prompts, Settings(max_tokens=args.tokens, speculative=False, **options))
                   for name, options in (("without", {}), ("repetition_penalty 1.2", dict(repetition_penalty=1.2)))}
        timings = alternate(runs | {f"regular {name}": run for name, run in regular.items()}, args.repeats)
        data["penalized"][label] = {name: {"tokens_per_second": t.output.generated / t.median,
                                           "acceptance": t.output.acceptance_rate, "tokens": t.output.generated}
                                    for name, t in timings.items()}
    return data


def render_processors(data: dict) -> str:
    rows = []
    for label, shape in data["shapes"].items():
        for name in PROCESSORS:
            regular = shape["regular"][name]
            row = [label if name == "none" else "", name, f"{regular['tokens_per_second']:.1f}",
                   "" if name == "none" else cost(regular["tokens_per_second"], shape["regular"]["none"]["tokens_per_second"])]
            if "speculative" in shape:
                round_ms = shape["speculative"][name]["ms_per_round"]
                row += [f"{round_ms:.2f}", "" if name == "none" else
                        cost(1 / round_ms, 1 / shape["speculative"]["none"]["ms_per_round"])]
            else:
                row += ["", ""]
            rows.append(row)
    text = (f"Each processor's cost, {data['tokens']} tokens forced (ignore_eos), batch 1, medians of {data['repeats']} "
            f"alternating runs; speculative at num-draft {data['num_draft']}, timed by the round (the penalties change "
            "which drafts pass, not what a round costs)\n\n"
            + table(["model", "processor", "regular tokens/s", "cost", "speculative ms a round", "cost"], rows))
    rows = []
    for label, runs in data["penalized"].items():
        base = runs["without"]
        for name in ("without", "repetition_penalty 1.2"):
            r, regular = runs[name], runs[f"regular {name}"]
            rows.append([label if name == "without" else "", name, f"{r['acceptance']:.2f}", f"{r['tokens_per_second']:.1f}",
                         ratio(r["tokens_per_second"], regular["tokens_per_second"]),
                         "" if name == "without" else ratio(r["tokens_per_second"], base["tokens_per_second"])])
    text += ("\n\nSpeculative decoding to the end of text with repetition_penalty 1.2, against without, on the trained "
             f"pairs ({data['prompts']} held-out demo prompts, up to {data['tokens']} tokens each)\n\n"
             + table(["pair", "penalty", "acceptance", "tokens/s", "over regular decoding with it", "over without"], rows))
    return text


def cost(value: float, base: float) -> str:
    """How much slower than the base a rate is, as a percentage (negative: faster)."""
    return f"{(base / value - 1) * 100:+.1f}%"


def run_beams(args) -> dict:
    """Beam search with 4 beams on the benchmark pair's target, on held-out
    demo prompts: ours against transformers' generate and CTranslate2's
    translate_batch (float32 and int8), each over every prompt a pass,
    alternating, with ours' greedy decoding beside them."""
    from loading import Models, load_model, load_tokenizer
    from options import Settings

    pair = fixtures.benchmark_pair(args.dir)
    models = Models(load_model(pair["target"]))
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(text) for text in fixtures.held_out_prompts(args.prompts or 6)]
    hf = HFWorker(pair["target_hf"])
    ct2 = {name: worker for name, worker in ct2_workers(pair["target_hf"], args.dir).items() if "Intel" not in name}
    runs = {"ours, 4 beams": ours_run(models, prompts, Settings(max_tokens=args.tokens, num_beams=4)),
            "transformers, 4 beams": worker_run(hf, prompts, args.tokens, beams=4)}
    runs |= {f"{name}, 4 beams": worker_run(worker, prompts, args.tokens, beams=4) for name, worker in ct2.items()}
    runs["ours, greedy"] = ours_run(models, prompts, Settings(max_tokens=args.tokens, speculative=False))
    timings = alternate(runs, args.repeats)
    versions = {"transformers, 4 beams": hf.version} | {f"{name}, 4 beams": w.version for name, w in ct2.items()}
    for worker in (hf, *ct2.values()):
        worker.close()
    ours = timings["ours, 4 beams"].output["tokens"]
    return {"prompts": len(prompts), "max_tokens": args.tokens, "repeats": args.repeats, "versions": versions,
            "contenders": {name: {"tokens_per_second": sum(map(len, t.output["tokens"])) / t.median,
                                  "tokens": sum(map(len, t.output["tokens"])),
                                  "same_tokens": sum(a == b for a, b in zip(t.output["tokens"], ours))}
                           for name, t in timings.items()}}


def render_beams(data: dict) -> str:
    ours = data["contenders"]["ours, 4 beams"]["tokens_per_second"]
    rows = [[name, data["versions"].get(name, ""), f"{c['tokens_per_second']:.1f}", c["tokens"],
             f"{c['same_tokens']} of {data['prompts']}", ratio(ours, c["tokens_per_second"])]
            for name, c in data["contenders"].items()]
    return (f"The benchmark pair's target (220 M parameters, float32), {data['prompts']} held-out demo prompts, up to "
            f"{data['max_tokens']} tokens, medians of {data['repeats']} alternating passes\n\n"
            + table(["decoding", "version", "tokens/s", "tokens", "prompts with ours' best beam", "ours' beams over it"],
                    rows))
