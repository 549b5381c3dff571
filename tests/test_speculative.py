"""Speculative decoding against independent references (transformers, exact distributions)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checkpoints import PROMPTS, exact_first_token_distribution, reference_greedy
from support import chi_square_passes, decode, regular, sampled

import main
import mlx.core as mx
import sweep
from decoder import verify
from rows import encode_for
from loading import Models
from options import Settings, Stats
from sampling import RowSampling, Sampling

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("draft", ["same", "close", "unrelated"])
@pytest.mark.parametrize("num_draft", [1, 2, 3, 5, 8])
def test_greedy_speculative_equals_regular_and_transformers_greedy(pair, draft, num_draft):
    checkpoint, target = pair["checkpoint"], pair["target"]
    prompt = checkpoint.prompt_ids
    stats = Stats()
    speculative = decode(Models(target, pair["drafts"][draft]), prompt, Settings(max_tokens=64, num_draft=num_draft), stats)
    assert speculative == regular(target, prompt, 64)
    assert speculative == reference_greedy(checkpoint.hf_model, prompt, 64)
    expected_acceptance = {"same": (1.0, 1.0), "close": (0.4, 0.99), "unrelated": (0.0, 0.2)}[draft]
    assert expected_acceptance[0] <= stats.acceptance_rate <= expected_acceptance[1], stats


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_delta_one_accepts_every_draft(pair, temp):
    stats = Stats()
    mx.random.seed(0)
    out = decode(Models(pair["target"], pair["drafts"]["unrelated"]), pair["checkpoint"].prompt_ids,
                 Settings(max_tokens=40, temp=temp, num_draft=4, delta=1.0), stats)
    assert stats.drafted > 0 and stats.acceptance_rate == 1.0
    assert stats.target_calls == -(-len(out) // 5)  # every verify step yields num_draft + 1 tokens


def rule_inputs(seed: int, rows: int, k: int = 6, vocab: int = 12):
    """Random target and draft logits and drafts for verify: (B, k + 1, V), (B, k, V), (B, k)."""
    rng = np.random.default_rng(seed)
    target_logits = mx.array(rng.normal(size=(rows, k + 1, vocab)) * 2, mx.float32)
    draft_logits = mx.array(rng.normal(size=(rows, k, vocab)) * 2, mx.float32)
    return target_logits, draft_logits, mx.array(rng.integers(0, vocab, size=(rows, k)))


def keys(rows: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [tuple(int(v) for v in rng.integers(0, 2**31, 2)) for _ in range(rows)]


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_accepted_drafts_only_grow_with_delta(temp):
    """verify itself, with p, q and each row's random stream fixed: a larger
    delta never accepts fewer drafts, and delta 1 accepts them all."""
    rows, k = 64, 6
    target_logits, draft_logits, drafts = rule_inputs(0, rows, k)
    sampling = RowSampling([Sampling(temp=temp)] * rows, keys(rows))
    positions = None if temp == 0 else mx.zeros((rows,), mx.int32)
    accepted = [np.array(verify(target_logits, draft_logits, drafts, sampling, delta, mx.full((rows,), k), positions)[0])
                for delta in np.linspace(0, 1, 21)]
    for smaller, larger in zip(accepted, accepted[1:]):
        assert (smaller <= larger).all()
    assert 0 < accepted[0].sum() < rows * k and (accepted[-1] == k).all()


def test_mean_acceptance_rises_with_delta_over_prompts(unit_scale_pair, tokenizer):
    target, draft = unit_scale_pair
    means = []
    for delta in (0.0, 0.2, 0.5, 0.8, 1.0):
        rates = []
        for prompt in PROMPTS:
            stats = Stats()
            decode(Models(target, draft), tokenizer.encode(prompt), Settings(max_tokens=48, num_draft=4, delta=delta), stats)
            rates.append(stats.acceptance_rate)
        means.append(float(np.mean(rates)))
    assert all(a <= b for a, b in zip(means, means[1:])), means
    assert means[0] < means[-1] == 1.0


@pytest.mark.parametrize("temp, top_p", [(1.0, 1.0), (1.0, 0.8)])
def test_speculative_sampling_first_token_follows_the_target_distribution(tiny_vocab_pair, temp, top_p):
    """Chi-square goodness of fit over 3000 samples, false-alarm rate 0.1%.

    max_tokens=4 with num_draft=3 makes the first token go through the
    accept / reject / resample path (the draft disagrees often here)."""
    (target, hf_target), (draft, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    prompt = [5, 3, 6, 1]
    expected = exact_first_token_distribution(hf_target, prompt, temp, top_p)
    mx.random.seed(1234)
    samples = 3000
    outputs, totals = sampled(Models(target, draft), prompt, Settings(max_tokens=4, temp=temp, top_p=top_p, num_draft=3),
                              samples)
    counts = np.bincount([out[0] if out else 1 for out in outputs], minlength=8)  # nothing generated: EOS (1) came first
    assert 0.1 < totals.acceptance_rate < 0.9, "the draft must be rejected sometimes for this to test anything"
    assert chi_square_passes(counts, expected), (counts / samples, expected)


def test_every_verify_pass_sees_the_cache_of_a_fresh_run(pair):
    """After each rejection and rollback, the target's logits equal a fresh full forward of the accepted prefix."""
    target, draft = pair["target"], pair["drafts"]["close"]
    prompt = pair["checkpoint"].prompt_ids
    calls, original = [], target.decode

    def recording_decode(tokens, cache):
        offset = cache.offset
        logits = original(tokens, cache)
        calls.append((offset, tokens.tolist()[0], np.array(logits[0])))
        return logits

    target.decode = recording_decode
    try:
        stats = Stats()
        out = decode(Models(target, draft), prompt, Settings(max_tokens=40, num_draft=4), stats)
    finally:
        del target.decode
    assert 0 < stats.accepted < stats.drafted, "needs both acceptances and rejections"
    sequence = [0] + out
    for offset, tokens, logits in calls:
        assert tokens[0] == sequence[offset]  # the step starts right after the accepted prefix
        (fresh_cache,) = encode_for([target], [prompt])  # encoded as decoding encodes, bit for bit
        fresh = original(mx.array([sequence[:offset] + tokens]), fresh_cache)
        np.testing.assert_allclose(logits, np.array(fresh[0, offset:]), rtol=0, atol=1e-4 * np.abs(logits).max())


@pytest.mark.parametrize("num_draft", [1, 3, 5, 8])
def test_eos_inside_the_drafts_stops_generation_at_eos(pair, num_draft, eos_at):
    target = eos_at(pair["target"], position=7)
    prompt = pair["checkpoint"].prompt_ids
    alone = regular(target, prompt, 40)
    assert len(alone) == 7
    stats = Stats()
    assert decode(Models(target, target), prompt, Settings(max_tokens=40, num_draft=num_draft), stats) == alone
    # Drafts after an accepted EOS are not counted: each counted draft is an output token or the EOS.
    assert stats.accepted == stats.drafted <= len(alone) + 1


@pytest.mark.parametrize("num_draft", [1, 3, 8])
def test_max_tokens_is_never_exceeded(pair, num_draft):
    target, prompt = pair["target"], pair["checkpoint"].prompt_ids
    for max_tokens in range(1, 12):
        for delta, temp in ((1.0, 0.0), (0.0, 1.0)):
            out = decode(Models(target, target), prompt, Settings(max_tokens=max_tokens, temp=temp, num_draft=num_draft,
                                                                   delta=delta))
            assert len(out) == max_tokens


def test_cli_json_speculative_stats(pair, capsys):
    checkpoint = pair["checkpoint"]
    assert main.main(["--model", str(checkpoint.mlx_dir), "--draft-model", str(checkpoint.mlx_dir),
                      "--num-draft", "4", "--delta", "0", "--max-tokens", "30", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    stats = result["stats"]
    assert result["tokens"] == reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 30)
    assert stats["accepted"] == stats["drafted"] == stats["draft_calls"] > 0
    assert stats["target_calls"] == 6 and stats["generated"] == 30


def test_a_draft_with_another_vocabulary_is_refused(pair, tiny_vocab_pair, tmp_path, capsys):
    checkpoint = pair["checkpoint"]
    other = tmp_path / "other"
    other.mkdir()
    for file in checkpoint.mlx_dir.iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 2000
    (other / "config.json").write_text(json.dumps(config))
    assert main.main(["--model", str(checkpoint.mlx_dir), "--draft-model", str(other), "--max-tokens", "5"]) != 0
    assert "output tokens" in capsys.readouterr().err


def test_interactive_loop_changes_knobs_and_survives_bad_commands(pair):
    mlx_dir = str(pair["checkpoint"].mlx_dir)
    script = "\n".join([
        ":num-draft 3", ":delta 0.5", ":temp 0", ":show", ":delta 7", ":num-draft two", ":seed -5", ":bogus",
        "translate English to French: hello", ":regular", "translate English to French: hello", ":compare", ":quit",
    ]) + "\n"
    done = subprocess.run([sys.executable, "main.py", "--model", mlx_dir, "--draft-model", mlx_dir, "--interactive",
                           "--max-tokens", "8"], input=script, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "mode speculative, num-draft 3, delta 0.5" in out
    assert ":delta must be a number in [0, 1] (got '7')" in out
    assert ":num-draft must be an integer in [1, 64] or auto (got 'two')" in out
    assert ":seed must be an integer in [0, 2**64) (got '-5')" in out
    assert "unknown command ':bogus'" in out
    assert "Accepted" in out and "decode steps, 8 tokens" in out
    assert "mode regular" in out and "speedup" in out


def test_interactive_loop_exits_on_end_of_input(pair):
    mlx_dir = str(pair["checkpoint"].mlx_dir)
    done = subprocess.run([sys.executable, "main.py", "--model", mlx_dir, "--draft-model", mlx_dir, "--interactive"],
                          input=":show\n", capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "mode speculative" in done.stdout


def test_interactive_runs_a_given_prompt_first(pair):
    mlx_dir = str(pair["checkpoint"].mlx_dir)
    done = subprocess.run([sys.executable, "main.py", "--model", mlx_dir, "--draft-model", mlx_dir, "--interactive",
                           "--prompt", PROMPTS[0], "--max-tokens", "5"],
                          input=":quit\n", capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"> {PROMPTS[0]}" in done.stdout and "Accepted" in done.stdout


def test_sweep_prints_a_table_marks_the_best_and_plots(pair, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    mlx_dir, prompts = str(pair["checkpoint"].mlx_dir), tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    plot = tmp_path / "sweep.png"
    assert main.main(["--model", mlx_dir, "--draft-model", mlx_dir, "--sweep", "--num-drafts", "1,3", "--deltas", "0,1",
                      "--prompts-file", str(prompts), "--max-tokens", "16", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "num-draft" not in line]
    assert len(rows) == 4 and sum("**best**" in row for row in rows) == 1
    assert "2 prompts" in out
    assert plot.stat().st_size > 1000


class ScriptedRuns:
    """Stands in for decoding in a sweep: regular decoding of 10 tokens
    takes 1, 2 then 4 s in passes 1-3; speculative decoding is 1.5x, 3x
    then 2x faster than the same pass's regular decoding."""

    regular_seconds, speedups = [1.0, 2.0, 4.0], [1.5, 3.0, 2.0]

    def __init__(self):
        self.calls = []

    def __call__(self, models, prompts, settings, batch_size):
        self.calls.append("speculative" if settings.speculative else "regular")
        done = self.calls.count("regular") - 1  # index of the current pass
        seconds = self.regular_seconds[done] / (self.speedups[done] if settings.speculative else 1)
        return Stats(generated=10, seconds=seconds, drafted=4 * settings.speculative, accepted=done)


def test_sweep_repeats_take_the_median_of_each_pass_own_speedup(capsys, monkeypatch):
    runs = ScriptedRuns()
    monkeypatch.setattr(sweep, "measure_batch", runs)
    monkeypatch.setattr(sweep, "warm_up_aloud", lambda *args: None)
    rows = sweep.sweep(None, ["one prompt"], Settings(), [2], [0.0], plot=None, repeats=3)
    assert runs.calls == ["regular", "speculative"] * 3  # regular decoding right before each setting
    (row,) = rows
    # Median of the per-pass ratios: 2x. (Ratio of the medians, 15 / 5 tokens/s, would say 3x.)
    assert row["speedup"] == pytest.approx(2.0) and row["speedup_range"] == pytest.approx((1.5, 3.0))
    assert row["tokens_per_second"] == pytest.approx(15.0)
    assert row["acceptance"] == pytest.approx((0 + 1 + 2) / 12)  # pooled over the passes
    out = capsys.readouterr().out
    assert "regular decoding 5.0 tokens/s, medians of 3 passes" in out
    assert "| 2 | 0.0 | 0.25 | 15.0 | 2.00x **best** | 1.50-3.00x |" in out


def test_a_sweep_not_at_a_terminal_says_what_it_will_run_and_how_far_it_has_come(capsys, monkeypatch):
    """In a log or a pipe, where no bar can draw (a README sweep once ran 657 s
    showing only "Loading ..."): the runs it will make, then a line at each
    tenth of them."""
    monkeypatch.setattr(sweep, "measure_batch", ScriptedRuns())
    monkeypatch.setattr(sweep, "warm_up_aloud", lambda *args: None)
    sweep.sweep(None, ["one prompt"], Settings(), [2, 4], [0.0, 0.5], plot=None, repeats=2)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "sweep: 10 runs (2 passes over 1 prompt: regular decoding and 4 settings); warming up ..."
    progress = [line for line in err[1:] if line.startswith("sweep: ")]
    assert [line.split(" (")[0] for line in progress] == [f"sweep: {10 * k}%" for k in range(1, 11)]
    assert progress[-1].startswith("sweep: 100% (10 of 10 runs) in ") and "to go" in progress[0]


def test_the_sweep_plots_legend_covers_no_point_and_no_line():
    """The README's grid (num-draft 1-8, four deltas, auto's dotted levels):
    no line, point or level passes under the legend's box."""
    pytest.importorskip("matplotlib")
    deltas = [0.0, 0.1, 0.5, 1.0]
    rows = [{"num_draft": n, "delta": d, "speedup": 1.0 + (d + 0.2) * (1 + (-1) ** n * 0.3)}
            for n in (1, 2, 3, 4, 6, 8) for d in deltas]
    rows += [{"num_draft": "auto", "delta": d, "speedup": 1.1 + d / 2} for d in deltas]
    figure = sweep.sweep_figure(rows, deltas)
    figure.canvas.draw()
    axes = figure.axes[0]
    legend = axes.get_legend().get_window_extent()
    crossing = [line.get_label() for line in axes.get_lines()
                if line.get_path().transformed(line.get_transform()).intersects_bbox(legend, filled=False)]
    sweep.import_pyplot().close(figure)
    assert not crossing, crossing


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sweep", "--deltas", ""], "--deltas must be a comma-separated list, each a number in [0, 1] (got '')"),
        (["--sweep", "--deltas", "0,1.5"], "--deltas must be a comma-separated list, each a number in [0, 1]"),
        (["--sweep", "--num-drafts", "0,2"], "--num-drafts must be a comma-separated list, each an integer in [1, 64]"),
        (["--sweep", "--repeats", "0"], "--repeats must be at least 1"),
        (["--repeats", "3"], "--repeats goes with --sweep"),
        (["--plot", "speedup.png"], "--plot goes with --sweep"),  # not silently ignored
        (["--num-drafts", "1,2"], "--num-drafts goes with --sweep"),
        (["--deltas", "0"], "--deltas goes with --sweep"),
        (["--draft-model", ""], "speculative decoding needs --draft-model"),
        (["--draft-model", "no-such-draft"], "no converted draft 'no-such-draft' (looked for"),  # and says:
        (["--draft-model", "no-such-draft"], "(or pass --regular-decode to run the target alone)"),
        (["--num-draft", "0"], "--num-draft must be an integer in [1, 64] or auto (got '0')"),
        (["--delta", "1.5"], "--delta must be a number in [0, 1] (got 1.5)"),
        (["--temp", "nan"], "--temp must be a number in [0, 100]"),
        (["--temp", "inf"], "--temp must be a number in [0, 100]"),
    ],
)
def test_bad_speculative_input_gives_one_line_error(pair, capsys, argv, message):
    mlx_dir = str(pair["checkpoint"].mlx_dir)
    assert main.main(["--model", mlx_dir, "--draft-model", mlx_dir, *argv]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_greedy_delta_zero_matches_argmax_ties_included():
    """On an exact tie regular greedy takes the lowest index; so must acceptance at delta 0."""
    target_logits = mx.array([[[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    greedy = RowSampling([Sampling()])
    for draft, accepted in ((2, 0), (1, 1)):
        count, _ = verify(target_logits, None, mx.array([[draft]]), greedy, 0.0, mx.array([1]), None)
        assert count.item() == accepted


def greedy_rule(target_logits: np.ndarray, drafts: np.ndarray, delta: float, limit: int) -> tuple[int, int]:
    """The greedy rule by hand, one row: drafts pass left to right while
    p(x) >= (1 - delta) max p, that is log p(x) - log max p >= log(1 - delta);
    then the target's argmax."""
    accepted = 0
    for scores, draft in zip(target_logits[:limit], drafts[:limit]):
        exact = draft == scores.argmax()
        if not (exact if delta == 0 else delta == 1 or scores[draft] - scores.max() >= np.log1p(-delta)):
            break
        accepted += 1
    return accepted, int(target_logits[accepted].argmax())


def test_verify_decides_each_row_of_a_mixed_batch_as_that_row_alone():
    """Greedy and sampled rows in one batch, each with its own delta, limit,
    temperature, top-k, top-p, random stream and output position: each row's
    count and next token are what verify gives that row alone, and a greedy
    row's are the greedy rule's, computed by hand."""
    rows, k = 8, 5
    target_logits, draft_logits, drafts = rule_inputs(3, rows, k)
    samplings = [Sampling(), Sampling(temp=1.0), Sampling(), Sampling(temp=0.7, top_k=4),
                 Sampling(temp=1.3, top_p=0.8), Sampling(), Sampling(temp=1.0, top_k=3, top_p=0.9), Sampling()]
    deltas = [0.0, 0.0, 0.5, 0.3, 0.0, 1.0, 0.6, 0.2]
    limits, positions, streams = [5, 3, 5, 0, 4, 2, 5, 1], [0, 7, 3, 12, 1, 0, 40, 9], keys(rows, seed=1)
    together = verify(target_logits, draft_logits, drafts, RowSampling(samplings, streams), mx.array(deltas),
                      mx.array(limits), mx.array(positions))
    together = [np.array(a).tolist() for a in together]
    for b in range(rows):
        alone = verify(target_logits[b : b + 1], draft_logits[b : b + 1], drafts[b : b + 1],
                       RowSampling([samplings[b]], [streams[b]]), deltas[b], mx.array([limits[b]]), mx.array([positions[b]]))
        assert (together[0][b], together[1][b]) == (alone[0].item(), alone[1].item()), f"row {b}"
        if samplings[b].temp == 0:
            assert (together[0][b], together[1][b]) == greedy_rule(np.array(target_logits[b]), np.array(drafts[b]),
                                                                   deltas[b], limits[b]), f"row {b}"
    assert together[0][5] == 2 and together[0][3] == 0  # delta 1 takes every draft weighed; limit 0 weighs none
