"""The shipped demo pair (demo/): trained models that agree, so acceptance means something."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import reference_greedy
from support import decode, regular
from mlx.utils import tree_flatten
from transformers import AutoTokenizer, T5ForConditionalGeneration

import convert
import main
import train
from loading import Models, load_model, load_tokenizer
from options import Settings, Stats

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"
SENTINEL = re.compile(r"<extra_id_(\d+)>")


@pytest.fixture(scope="module")
def demo():
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(p) for p in main.demo_prompts()]  # 20 held-out prompts
    return load_model(DEMO / "target"), load_model(DEMO / "draft"), tokenizer, prompts


def mean_acceptance(target, draft, prompts, num_draft, delta) -> float:
    rates = []
    for prompt in prompts:
        stats = Stats()
        decode(Models(target, draft), prompt, Settings(num_draft=num_draft, delta=delta), stats)
        rates.append(stats.acceptance_rate)
    return float(np.mean(rates))


def test_demo_weights_fit_in_40_mb():
    files = list(DEMO.glob("*/model*.safetensors"))
    assert {f.parent.name for f in files} == {"target", "draft"}
    assert sum(f.stat().st_size for f in files) <= 40e6


def test_target_fills_each_masked_span_and_most_fillings_are_varied_text(demo):
    """Each prompt gets its own filling of its sentinel. A small model's greedy
    output sometimes falls into a row of one piece (`_____`, `'/', '/', '/'`):
    14 of the 20 shipped prompts get varied text; at least two thirds must."""
    target, _, tokenizer, prompts = demo
    outputs, varied = [], 0
    for prompt in prompts:
        tokens = regular(target, prompt, 100)
        assert len(tokens) < 100, "no EOS: the output should end after the last span"
        text = tokenizer.decode(tokens)
        masked = [int(n) for n in SENTINEL.findall(tokenizer.decode(prompt))]
        assert [int(n) for n in SENTINEL.findall(text)] == masked, text  # each span, in order
        words = [t for t in tokens if t not in AutoTokenizer.from_pretrained(str(DEMO / "target")).all_special_ids]
        varied += len(set(words)) >= 4 and max(map(words.count, words)) <= len(words) / 2  # not one piece repeated
        outputs.append(text)
    assert len(set(outputs)) == len(outputs), outputs  # each prompt gets its own filling
    assert varied >= 2 / 3 * len(prompts), outputs


def test_greedy_acceptance_is_between_half_and_nine_tenths(demo):
    target, draft, _, prompts = demo
    assert 0.5 <= mean_acceptance(target, draft, prompts, num_draft=4, delta=0.0) <= 0.9


def test_the_demo_opens_with_the_prompt_of_median_acceptance(demo):
    """main.py --demo shows one prompt: a typical one, not the best or the worst."""
    target, draft, _, prompts = demo
    rates = []
    for prompt in prompts:
        stats = Stats()
        defaults = main.DEMO_DEFAULTS
        decode(Models(target, draft), prompt, Settings(num_draft=defaults["num_draft"], delta=defaults["delta"]), stats)
        rates.append(stats.acceptance_rate)
    assert rates[main.DEMO_PROMPT - 1] == pytest.approx(np.median(rates), abs=0.05), rates


def test_acceptance_rises_with_delta(demo):
    target, draft, _, prompts = demo
    means = [mean_acceptance(target, draft, prompts, 4, delta) for delta in (0.0, 0.3, 0.6, 0.9, 1.0)]
    assert all(a <= b for a, b in zip(means, means[1:])), means
    assert means[0] + 0.1 < means[3] and means[-1] == 1.0, means


@pytest.mark.parametrize("num_draft", [1, 2, 3, 4, 5, 6, 8])
def test_greedy_speculative_equals_regular_greedy_for_every_num_draft(demo, num_draft):
    target, draft, _, prompts = demo
    for prompt in prompts[:8]:
        assert decode(Models(target, draft), prompt, Settings(num_draft=num_draft)) == regular(target, prompt, 100)


@pytest.mark.parametrize("name", ["target", "draft"])
def test_demo_model_round_trips_through_a_hugging_face_checkpoint(demo, name, tmp_path):
    """Exported with train.py's writer, the model converts back bit for bit,
    and transformers decodes the same greedy tokens from it."""
    shipped = load_model(DEMO / name)
    hf_dir = train.save_hugging_face(shipped, DEMO / name, tmp_path / "hf")
    convert.convert(str(hf_dir), tmp_path / "mlx", "float32", force=False)
    again = dict(tree_flatten(load_model(tmp_path / "mlx").parameters()))
    for key, value in tree_flatten(shipped.parameters()):
        assert np.array_equal(np.array(value), np.array(again[key])), key

    hf_model = T5ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    for prompt in demo[3][:2]:
        with torch.no_grad():
            assert regular(shipped, prompt, 60) == reference_greedy(hf_model, prompt, 60)


def test_cli_demo_shows_the_prompt_output_acceptance_speedup_and_filled_in_text():
    done = subprocess.run([sys.executable, "main.py", "--demo"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert main.demo_prompts()[main.DEMO_PROMPT - 1] in out
    assert re.search(r"Accepted \d+ / \d+ drafts \(\d+%; \d+\.\d a round\)", out)
    assert re.search(r"Speculative decoding ran \d+\.\d\dx as fast as regular decoding on this prompt", out)
    filled = out.split("Filled in:\n")[1]
    assert "«" in filled and "<extra_id_0>" not in filled
    first, *rest = done.stderr.splitlines()  # nothing else: no warnings, no noise
    assert first == "Loading demo/target and demo/draft ..."
    # A machine's first run only (and the first to need the demo's kernels): the wait for MLX's compiler, said
    assert all(line.startswith(("First run of MLX", "Warmed up in ")) for line in rest) and len(rest) <= 2, rest


def test_cli_demo_interactive_runs_a_demo_prompt_by_number_and_help_lists_it():
    script = ":demo 2\n:demo 99\n:help\n:quit\n"
    done = subprocess.run([sys.executable, "main.py", "--demo", "--interactive", "--max-tokens", "40"],
                          input=script, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert main.demo_prompts()[1] in done.stdout and "Filled in" in done.stdout
    assert ":demo takes a prompt number from 1 to" in done.stdout
    assert done.stdout.count(":demo N") == 2  # at start-up and after :help


def test_cli_demo_sweep_runs_over_the_held_out_prompts_and_repeats(capsys):
    argv = ["--demo", "--sweep", "--num-drafts", "1,4", "--deltas", "0,1", "--max-tokens", "10", "--repeats", "2"]
    assert main.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{len(main.demo_prompts())} prompts" in out and "medians of 2 passes" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "num-draft" not in line]
    assert len(rows) == 4
    assert [row[2] for row in rows if row[1] == "1.0"] == ["1.00", "1.00"]  # delta 1 accepts every draft

