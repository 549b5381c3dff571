"""docs/PERFORMANCE.md and the README's performance table, made from bench/results/*.json alone.

`python -m bench render` writes both; tests/test_docs.py checks that what
is there is what these results render, so no figure there comes from anywhere else.
"""

import json
import statistics

from bench import COMMANDS
from bench.harness import RESULTS, ROOT, describe, table

PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
README = ROOT / "README.md"
BLOCK = "<!-- rendered from bench/results: {} -->"  # and a block ends at END
END = "<!-- end of the table -->"

INTRO = """# Performance

Current figures, one section per `python -m bench` command, each rendered by
`python -m bench render` from the result that command wrote
(bench/results/COMMAND.json): run a command again and render to bring its
section up to date. Each section names its command and the machine it ran on:
ratios move from machine to machine, so compare within a section, not across.
Why the code is as these figures made it: [DECISIONS.md](DECISIONS.md).
"""


def results(gpu: bool = False) -> dict:
    """Every command's result, by name, in COMMANDS' order; missing ones left out. With `gpu`, the results of
    commands run where MLX computes on a GPU (COMMAND-gpu.json)."""
    found = {}
    for name in COMMANDS:
        path = RESULTS / f"{name}{'-gpu' if gpu else ''}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def performance(found: dict, on_gpu: dict) -> str:
    sections = [INTRO]
    for name, result, where in [*((n, r, "") for n, r in found.items()), *((n, r, ", on a GPU") for n, r in on_gpu.items())]:
        title, _, render = COMMANDS[name]
        sections.append(f"## {title}{where}\n\n`{result['command']}`: {describe(result['machine'])}, {result['date']}\n\n"
                        f"{render(result['data'])}\n")
    return "\n".join(sections)


def headline(found: dict) -> str:
    """The README's table: one ratio a cell, each from a command's result."""
    rows = []

    def row(command: str, what: str, against: str, value: float | None, unit: str = "x") -> None:
        if value is not None:
            machine = found[command]["machine"]
            detail = f" ({machine['detail']})" if machine["detail"] else ""
            rows.append([f"{what} (`{found[command]['command']}`)", against, f"{value:.2f}{unit}",
                         f"{machine['cpu']}{detail}, {machine['cores']} cores, {machine['blas']}"])

    if "regular" in found:
        rate = found["regular"]["data"]["tokens_per_second"]
        row("regular", "regular decoding, T5-large shapes", "transformers", rate["ours"] / rate["transformers"])
        if "CTranslate2 fp32" in rate:
            row("regular", "regular decoding, T5-large shapes", "CTranslate2 fp32", rate["ours"] / rate["CTranslate2 fp32"])
    if "speculative" in found:
        c = {k: v["tokens_per_second"] for k, v in found["speculative"]["data"]["contenders"].items()}
        auto = c["ours num-draft auto"]
        what = "speculative decoding, num-draft auto, the benchmark pair"
        row("speculative", what, "ours, regular decoding", auto / c["ours regular"])
        assisted = max(c["transformers assisted"], c["transformers assisted, cache fixed"])
        row("speculative", what, "transformers' assisted generation (as installed or its cache fixed: the faster)",
            auto / assisted)
        if "CTranslate2 int8" in c:
            row("speculative", what, "CTranslate2 int8", auto / c["CTranslate2 int8"])
    if "batch" in found and "benchmark pair" in found["batch"]["data"]["pairs"]:
        data = found["batch"]["data"]
        seconds = data["pairs"]["benchmark pair"]["seconds"]
        size = 8 if 8 in data["sizes"] else data["sizes"][-1]
        best = min(seconds[f"speculative {k} {size}"] for k in data["num_drafts"])
        row("batch", f"batched speculative decoding, {data['prompts']} prompts in batches of {size}, the benchmark pair",
            "transformers' batched generate", seconds[f"transformers {size}"] / best)
    if "encode" in found:
        for r in found["encode"]["data"]["rows"]:
            if r["model"] == "T5-large shapes" and r["tokens"] == 2048:
                row("encode", "time to the first token, a 2,048-token prompt, T5-large shapes", "transformers",
                    r["ours"]["seconds"] / r["transformers"]["seconds"], unit=" of its time")
    if "whisper" in found:
        for r in found["whisper"]["data"]["rows"]:
            if r["shape"] == "base" and r.get("real") and r["audio_seconds"] == 300 and r["same_tokens"]:
                row("whisper", "transcribing 5 minutes of speech, real Whisper base", "transformers",
                    statistics.median(r["transformers"]) / statistics.median(r["ours"]))
    return table(["measurement (command)", "against", "ours over it", "machine"], rows)


def readme_tables(found: dict) -> dict[str, str]:
    """The README's rendered tables, by block name."""
    from bench.memory import pairs_table, sizes_table

    sizes = found["sizes"]["data"] if "sizes" in found else None
    return {"headline": headline(found), "sizes": sizes_table(sizes) if sizes else "",
            "pairs": pairs_table(sizes) if sizes else ""}


def readme_with(tables: dict[str, str]) -> str:
    text = README.read_text()
    for name, table_text in tables.items():
        start = text.index(BLOCK.format(name)) + len(BLOCK.format(name))
        end = text.index(END, start)
        text = text[:start] + "\n" + table_text + "\n" + text[end:]
    return text


def write() -> None:
    found = results()
    PERFORMANCE.write_text(performance(found, results(gpu=True)))
    README.write_text(readme_with(readme_tables(found)))
    print(f"wrote {PERFORMANCE.relative_to(ROOT)} and the README's tables from {len(found)} results")
