"""`rounding`: how far ours and transformers' float32 logits fall from float64 on each family's random fixtures.

Every family of checkpoints.FAMILY_CHECKPOINTS at the tests' seed and seeds 0-4, three prompts each, the logits
along transformers' greedy output (as tests/test_families.py compares them): ours and transformers' own run against
the model in float64, and the farthest of transformers' eight draws (its own run and seven copies of its weights,
each weight moved by a rounding: checkpoints.farthest_float32). The families' fixtures amplify rounding, so one
run's ratio is chance; the farthest draw is the spread a float32 computation falls in. On the path and BLAS this
process takes (T5_MLX_PATH, T5_MLX_BLAS).
"""

import contextlib
import io
import statistics

from bench.harness import table

SEEDS = (None, 0, 1, 2, 3, 4)  # None: the tests' own seed for the family
DRAWS = 7  # transformers' copies beside its own run


def run_rounding(args) -> dict:
    import mlx.core as mx
    import numpy as np
    import torch
    import transformers

    import convert
    from checkpoints import (FAMILY_CHECKPOINTS, FAMILY_PROMPTS, family_checkpoint, farthest_float32, in_float64,
                             reference_greedy, train_tokenizer)
    from loading import load_model

    root = args.dir / "rounding"
    tokenizer = root / "tokenizer"
    if not (tokenizer / "spiece.model").exists():
        train_tokenizer(tokenizer)
    rows = []
    for kind in FAMILY_CHECKPOINTS:
        for seed in SEEDS:
            folder = root / f"{kind}-{seed}"
            with contextlib.redirect_stderr(io.StringIO()):  # (progress bars)
                if not (folder / "mlx" / "config.json").exists():
                    family_checkpoint(kind, folder / "hf", tokenizer, seed=seed)
                    convert.convert(str(folder / "hf"), folder / "mlx", "float32", force=True)
                hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(folder / "hf")).eval()
            exact_model, ours_model = in_float64(hf), load_model(folder / "mlx")
            for number, prompt in enumerate(FAMILY_PROMPTS):
                decoded = [hf.config.decoder_start_token_id] + reference_greedy(hf, prompt, 20)

                def logits(model):
                    with torch.no_grad():
                        return model(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([decoded])).logits.numpy()

                exact = logits(exact_model)
                cache = ours_model.make_cache(ours_model.encode(mx.array([prompt])))
                ours = np.array(ours_model.decode(mx.array([decoded]), cache))
                distance = {name: float(np.abs(np.asarray(value, np.float64) - exact).max()) for name, value in
                            (("ours", ours), ("transformers", logits(hf)),
                             ("farthest", farthest_float32(hf, logits, exact, samples=DRAWS)))}
                rows.append({"family": kind, "seed": seed, "prompt": number, **distance})
    return {"draws": DRAWS + 1, "rows": rows}


def render_rounding(data: dict) -> str:
    lines = []
    for kind in dict.fromkeys(row["family"] for row in data["rows"]):
        rows = [row for row in data["rows"] if row["family"] == kind]
        one_run = [row["ours"] / row["transformers"] for row in rows]
        spread = [row["ours"] / row["farthest"] for row in rows]
        lines.append([kind, len(rows), f"{statistics.median(one_run):.2f}x", f"{max(one_run):.2f}x",
                      sum(r > 4 for r in one_run), f"{max(spread):.2f}x"])
    return (f"Logits along the greedy output, each family's fixtures at the tests' seed and seeds 0-4, three prompts each: "
            f"ours over transformers' own float32 run, each from float64, and ours over the farthest of transformers' "
            f"{data['draws']} draws (its run and copies with each weight moved by a rounding; the families' test allows 2x)"
            "\n\n" + table(["family", "prompts", "ours / transformers' run, median", "largest", "over 4x",
                            "ours / farthest draw, largest"], lines))
