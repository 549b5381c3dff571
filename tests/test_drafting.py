"""Drafting without hand-tuning: num-draft auto and prompt lookup. Both are
exact where speculative decoding is (greedy at delta 0, sampling's
distribution), auto drafts more or less as the target accepts, lookup finds
copies in the encoder's input, and what cannot run is refused."""

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from checkpoints import PROMPTS, exact_first_token_distribution, reference_greedy

import main
import mlx.core as mx
from decoder import (OptionError, Request, Row, Settings, Stats, encode_prompts, regular_generate, speculative_batch,
                     speculative_generate)
from drafting import AutoDraft, DraftModel, PromptLookup
from generate import generate
from interactive import Session
from loading import Models, load, load_tokenizer
from sampling import RowSampling, Sampling

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"


@pytest.fixture(scope="module")
def prompt_ids(pair):
    tokenizer = load_tokenizer(pair["checkpoint"].mlx_dir)
    return [tokenizer.encode(prompt) for prompt in PROMPTS[:4]]


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("draft", ["close", "unrelated"])
def test_greedy_auto_equals_regular_and_transformers_greedy(pair, draft):
    target, checkpoint = pair["target"], pair["checkpoint"]
    prompt, stats = checkpoint.prompt_ids, Stats()
    out = list(speculative_generate(target, pair["drafts"][draft], prompt, 64, Sampling(), "auto", 0.0, stats))
    assert out == list(regular_generate(target, prompt, 64, Sampling()))
    assert out == reference_greedy(checkpoint.hf_model, prompt, 64)
    assert stats.drafted > 0


@pytest.mark.parametrize("num_draft", [1, 3, 8])
def test_greedy_prompt_lookup_equals_regular_and_transformers_greedy(pair, num_draft):
    target, checkpoint = pair["target"], pair["checkpoint"]
    prompt = checkpoint.prompt_ids
    out = list(speculative_generate(target, None, prompt, 64, Sampling(), num_draft, 0.0))
    assert out == list(regular_generate(target, prompt, 64, Sampling()))
    assert out == reference_greedy(checkpoint.hf_model, prompt, 64)


@pytest.mark.parametrize("draft, num_draft", [("close", "auto"), (None, 4)])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_batched_auto_and_lookup_rows_equal_each_prompt_alone(pair, prompt_ids, draft, num_draft, batch_size):
    target = pair["target"]
    alone = [list(regular_generate(target, prompt, 40, Sampling())) for prompt in prompt_ids]
    stats = [Stats() for _ in prompt_ids]
    tokens = {i: [] for i in range(len(prompt_ids))}
    draft_model = pair["drafts"][draft] if draft else None
    for index, token, _ in speculative_batch(target, draft_model, prompt_ids, 40, Sampling(), num_draft, 0.0, stats,
                                             batch_size):
        tokens[index] += [] if token is None else [token]
    assert [tokens[i] for i in range(len(prompt_ids))] == alone


def chi_square_passes(counts: np.ndarray, expected: np.ndarray) -> bool:
    """Goodness of fit at a false-alarm rate of 0.1%; no count outside the support."""
    support, samples = expected > 0, counts.sum()
    assert counts[~support].sum() == 0, "sampled a token the target cannot produce"
    chi2 = (((counts - samples * expected) ** 2)[support] / (samples * expected[support])).sum()
    critical = {7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}[int(support.sum()) - 1]
    return chi2 < critical


@pytest.mark.parametrize("temp, top_p", [(1.0, 1.0), (1.0, 0.8)])
def test_sampling_with_looked_up_drafts_follows_the_target_distribution(tiny_vocab_pair, temp, top_p):
    """The target's most frequent first token, 0, occurs in the prompt
    followed by 7 (which the target gives about 15%), so after it the second
    token is a looked-up draft (q one-hot), accepted or resampled: the
    second token's distribution given that first token passes a chi-square
    test against the target's, and so does the first token's."""
    target, hf_target = tiny_vocab_pair["target"]
    prompt = [0, 3, 5, 4, 3, 4, 0, 7, 1]
    sampling = Sampling(temp=temp, top_p=top_p)
    mx.random.seed(4321)
    outputs, totals = [], Stats()
    for _ in range(3000):
        outputs.append(list(speculative_generate(target, None, prompt, 3, sampling, 1, 0.0, totals)))
    assert 0.05 < totals.acceptance_rate < 0.9, "looked-up drafts must be both accepted and rejected for this to test anything"
    firsts = np.bincount([out[0] if out else 1 for out in outputs], minlength=8)
    assert chi_square_passes(firsts, exact_first_token_distribution(hf_target, prompt, temp, top_p))
    first = int(np.argmax(np.where(np.arange(8) == 1, 0, firsts)))
    seconds = np.bincount([out[1] if len(out) > 1 else 1 for out in outputs if out and out[0] == first], minlength=8)
    assert chi_square_passes(seconds, exact_first_token_distribution(hf_target, prompt, temp, top_p, after=(first,)))


@pytest.mark.parametrize("temp, top_p", [(1.0, 1.0), (1.0, 0.8)])
def test_sampling_with_auto_follows_the_target_distribution(tiny_vocab_pair, temp, top_p):
    """auto drafts as many tokens as the draft's confidences make worth it;
    the first token's distribution, and the second's given the most frequent
    first, are still the target's."""
    (target, hf_target), (draft, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    prompt = [5, 3, 6, 1]
    sampling = Sampling(temp=temp, top_p=top_p)
    mx.random.seed(1234)
    outputs, totals, auto = [], Stats(), AutoDraft()
    for _ in range(3000):
        outputs.append(list(speculative_generate(target, draft, prompt, 4, sampling, auto, 0.0, totals)))
    assert 0.1 < totals.acceptance_rate < 0.9
    firsts = np.bincount([out[0] if out else 1 for out in outputs], minlength=8)
    assert chi_square_passes(firsts, exact_first_token_distribution(hf_target, prompt, temp, top_p))
    first = int(np.argmax(np.where(np.arange(8) == 1, 0, firsts)))
    seconds = np.bincount([out[1] if len(out) > 1 else 1 for out in outputs if out and out[0] == first], minlength=8)
    assert chi_square_passes(seconds, exact_first_token_distribution(hf_target, prompt, temp, top_p, after=(first,)))


class DropsTheSecond(AutoDraft):
    """Decides against the second draft every round, once it is made."""

    def decide(self, reach, limits, made):
        return False, False


def test_a_dropped_draft_leaves_the_draft_cache_as_one_draft_would(pair):
    """Dropping the late draft rolls the draft's cache back a position: every
    round then proposes what num-draft 1 proposes (a stale position would
    change the draft's next proposals, and so the counts)."""
    target, draft, prompt = pair["target"], pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    dropped, one = Stats(), Stats()
    out = list(speculative_generate(target, draft, prompt, 40, Sampling(), DropsTheSecond(), 0.0, dropped))
    assert out == list(speculative_generate(target, draft, prompt, 40, Sampling(), 1, 0.0, one))
    assert (dropped.drafted, dropped.accepted, dropped.target_calls) == (one.drafted, one.accepted, one.target_calls)


# ---------------------------------------------------------------- auto's rule


def drafts_taken(auto: AutoDraft, draft, prompt: list[int]) -> int:
    """How many tokens auto drafts in one round from a fresh cache: the same confidences every time."""
    cache, drafter = encode_prompts(draft, [prompt]), DraftModel(draft, auto)
    row = Row(Request(prompt), 0.0, (0, 0))
    drafter.start(row)
    proposal = drafter.propose([row], [AutoDraft.cap], RowSampling([Sampling()]), mx.array([0]), cache)
    return proposal.drafts.shape[1]


def learnt(rounds: list[tuple[int, int]]) -> AutoDraft:
    """An AutoDraft after rounds of (drafts, accepted), each at confidence 0.5
    and at the same speed (seconds in proportion to tokens), with a draft step
    that costs a tenth of a token's time: the same clock for every test."""
    auto = AutoDraft()
    auto.timed = lambda seconds: None  # the test's clock, not the machine's
    auto.draft_seconds = 0.001
    for drafted, accepted in rounds:
        auto.learn([[0.5] * drafted], [accepted], 0.01 * (accepted + 1))
    return auto


def test_auto_drafts_more_after_full_acceptance_and_less_after_rejections(pair):
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    mixed = [(4, 2)] * 10
    before = drafts_taken(learnt(mixed), draft, prompt)
    after_acceptances = drafts_taken(learnt(mixed + [(4, 4)] * 10), draft, prompt)
    after_rejections = drafts_taken(learnt(mixed + [(4, 0)] * 10), draft, prompt)
    assert after_rejections < before < after_acceptances, (after_rejections, before, after_acceptances)
    assert after_rejections >= 1 and after_acceptances <= AutoDraft.cap


def test_auto_drafts_less_when_a_draft_step_costs_more(pair):
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    cheap, dear = learnt([(4, 3)] * 10), learnt([(4, 3)] * 10)
    dear.draft_seconds = 0.005
    assert drafts_taken(dear, draft, prompt) < drafts_taken(cheap, draft, prompt)


def test_auto_can_draft_a_single_token_a_round(pair):
    """Half the drafts pass: a second draft adds a quarter of a token. At a
    tenth of a token's time a draft, auto drafts it; at three tenths, it
    decides so before running the second draft's step: one draft a round."""
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    cheap, dear = learnt([(4, 1)] * 20), learnt([(4, 1)] * 20)
    dear.draft_seconds = 0.003
    assert drafts_taken(cheap, draft, prompt) >= 2
    assert drafts_taken(dear, draft, prompt) == 1


def test_auto_stops_drafting_at_the_drafts_end_of_text(pair):
    """Tokens drafted after an end of text never reach the output: with the
    draft's first token made the end of text, auto keeps that one draft only,
    where it otherwise drafts several."""
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    confident = learnt([(4, 4)] * 20)
    confident.floors = {(1, 1): [0.014, 20], (1, 4): [0.026, 20]}  # a draft: its step and as much again in the target's pass
    confident.fit_slope()
    assert drafts_taken(confident, draft, prompt) >= 3
    cache = encode_prompts(draft, [prompt])
    first = draft.decode(mx.array([[draft.args.decoder_start_token_id]]), cache)[0, -1].argmax().item()
    eos = draft.args.eos_token_id
    try:
        draft.args.eos_token_id = first
        assert drafts_taken(confident, draft, prompt) == 1
    finally:
        draft.args.eos_token_id = eos


def test_auto_keeps_a_measured_draft_cost_through_rounds_of_one_length():
    """The cost of a draft is the slope of round time against round length;
    rounds of one length measure no slope, and the lengths seen before keep
    theirs (the draft step alone would make the next draft look cheap)."""
    auto = AutoDraft()
    auto.draft_seconds = 0.001
    for steps in [1, 4] * 10:
        auto.steps = steps
        auto.learn([[0.5] * steps], [steps], 0.01 + 0.004 * steps)
    assert auto.draft_cost == pytest.approx(0.004)
    for _ in range(300):
        auto.steps = 1
        auto.learn([[0.5]], [1], 0.014)
    assert auto.draft_cost == pytest.approx(0.004)


def test_auto_measures_a_draft_cost_that_a_busy_machine_does_not_inflate():
    """A busy machine slows rounds down by some share of their time, never
    speeds them up: with a third of the rounds slowed by up to 3x, the cost
    of a draft stays where the quiet rounds put it (a slope through every
    round's seconds grows with the slowdowns)."""
    rng = random.Random(0)
    auto = AutoDraft()
    auto.draft_seconds = 0.001
    for i in range(200):
        auto.steps = 1 + i % 4
        slowdown = 1 + 2 * rng.random() if rng.random() < 1 / 3 else 1
        auto.learn([[0.5] * auto.steps], [auto.steps], (0.01 + 0.002 * auto.steps) * slowdown)
    assert auto.draft_cost == pytest.approx(0.002, rel=0.05)


def test_auto_does_not_price_drafts_by_one_slow_round():
    """A round length seen once may have traced a graph (a new cache size):
    its time does not set the cost of a draft until AutoDraft.trusted rounds
    of it were seen, or auto, finding a second draft dear, would never draft
    two again to learn otherwise."""
    auto = AutoDraft()
    auto.draft_seconds = 0.0005
    auto.shapes = {(1, 1): 2, (1, 2): 2}  # past the rounds that run plainly and trace
    for steps, seconds in [(1, 0.004)] * 20 + [(2, 0.009)]:
        auto.steps = steps
        auto.learn([[0.5] * steps], [steps], seconds)
    assert auto.draft_cost == pytest.approx(0.0005)
    for _ in range(AutoDraft.trusted - 1):
        auto.learn([[0.5] * 2], [2], 0.0046)
    assert auto.draft_cost == pytest.approx(0.0006, rel=0.05)


def test_auto_reports_its_mean_drafts_per_round(pair):
    stats = Stats()
    list(speculative_generate(pair["target"], pair["drafts"]["close"], pair["checkpoint"].prompt_ids, 30, Sampling(),
                              "auto", 0.0, stats))
    assert stats.drafts_per_round == stats.drafted / stats.target_calls > 0
    assert "drafts_per_round" in stats.to_dict()


# ---------------------------------------------------------------- prompt lookup


def test_lookup_copies_a_span_found_only_in_the_prompt():
    lookup = PromptLookup([10, 11, 12, 13, 14, 15, 1])
    lookup.add([7, 11, 12])
    assert lookup.draft(3) == [13, 14, 15]
    assert lookup.draft(10) == [13, 14, 15, 1]  # to the prompt's end


def test_lookup_prefers_the_longest_match_and_never_matches_its_own_tail():
    lookup = PromptLookup([3, 5, 6, 8, 5, 9, 1])  # (3, 5) is followed by 6; 5, last, by 9
    lookup.add([3, 5])
    assert lookup.draft(1) == [6]  # the 2-gram, not the 1-gram's last occurrence
    lookup = PromptLookup([1])
    lookup.add([4, 4])  # (4,) occurred before the tail; (4, 4) only as the tail
    assert lookup.draft(3) == [4]
    assert PromptLookup([2, 3, 1]).draft(4) == []  # no output yet: nothing to match


def test_lookup_prefers_the_output_over_the_prompt_at_equal_length():
    lookup = PromptLookup([20, 21, 1])
    lookup.add([20, 30, 20])
    assert lookup.draft(2) == [30, 20]


def test_lookup_drafts_from_the_encoder_input_are_accepted_on_a_copying_prompt():
    """The demo target copies an identifier from its context: lookup drafts
    it, the target accepts, and the output is its own greedy output."""
    models = load(DEMO / "target")
    prompt = ("for filename in sorted(os.listdir(directory)): path = os.path.join(directory, filename) "
              "if os.path.isfile(<extra_id_0>): yield path")
    ids = models.tokenizer.encode(prompt)
    stats = Stats()
    out = list(speculative_generate(models.target, None, ids, 20, Sampling(), 8, 0.0, stats))
    assert out == list(regular_generate(models.target, ids, 20, Sampling()))
    assert stats.accepted >= 3 and stats.draft_calls == 0


# ---------------------------------------------------------------- what cannot run


@pytest.mark.parametrize("argv, message", [
    (["--num-draft", "auto", "--regular-decode"], "--num-draft auto is for speculative decoding: drop --regular-decode"),
    (["--prompt-lookup", "--draft-model", "demo/draft"], "--prompt-lookup drafts without a draft model: drop --draft-model"),
    (["--prompt-lookup", "--regular-decode"], "--prompt-lookup is for speculative decoding: drop --regular-decode"),
    (["--prompt-lookup", "--num-draft", "auto"], "--num-draft auto follows a draft model's confidence"),
    (["--num-draft", "often"], "--num-draft must be an integer >= 1 or auto (got 'often')"),
    (["--sweep", "--prompt-lookup", "--num-drafts", "2,auto"], "--num-drafts: auto follows a draft model's confidence"),
])
def test_drafting_options_that_cannot_run_get_one_line_errors(capsys, argv, message):
    assert main.main(["--demo"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_api_refuses_auto_without_a_draft_model_and_with_lookup():
    models = load(DEMO / "target")
    with pytest.raises(OptionError, match="no draft model is loaded"):
        generate(models, "x = 1", num_draft="auto")
    with pytest.raises(OptionError, match="prompt lookup takes a number"):
        Settings(num_draft="auto", prompt_lookup=True)


def test_the_loop_refuses_auto_without_a_draft_model_and_switches_to_lookup():
    models = load(DEMO / "target")
    out = io.StringIO()
    session = Session(models, Settings(speculative=False), out=out)
    session.command(":num-draft auto")
    assert "num-draft 'auto' follows a draft model's confidence, and no draft model is loaded" in out.getvalue()
    assert session.settings.num_draft == 5
    session.command(":lookup")
    assert session.settings.prompt_lookup and "mode speculative, prompt lookup" in out.getvalue()
    session.command(":num-draft auto")
    assert session.settings.num_draft == 5


def test_the_loop_takes_auto_with_a_draft_model():
    models = load(DEMO / "target", draft=DEMO / "draft")
    out = io.StringIO()
    session = Session(models, Settings(), out=out)
    session.command(":num-draft auto")
    assert session.settings.num_draft == "auto" and "num-draft auto" in out.getvalue()


# ---------------------------------------------------------------- in the tools


def test_sweep_and_json_take_auto_and_prompt_lookup(capsys):
    assert main.main(["--demo", "--sweep", "--num-drafts", "2,auto", "--deltas", "0", "--max-tokens", "10"]) == 0
    table = capsys.readouterr().out
    assert "| 2 | 0.0 |" in table and "| auto | 0.0 |" in table
    assert main.main(["--demo", "--sweep", "--prompt-lookup", "--num-drafts", "2,4", "--deltas", "0", "--max-tokens", "10"]) == 0
    assert "| 4 | 0.0 |" in capsys.readouterr().out
    assert main.main(["--demo", "--prompt-lookup", "--num-draft", "4", "--max-tokens", "10", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["draft_calls"] == 0 and stats["target_calls"] <= 10


def test_compare_runs_prompt_lookup_against_regular(capsys):
    assert main.main(["--demo", "--compare", "--prompt-lookup", "--max-tokens", "10"]) == 0
    out = capsys.readouterr().out
    assert "--- regular" in out and "--- speculative" in out and "prompt lookup)" in out


def test_models_keep_what_auto_learnt_between_generations():
    models = load(DEMO / "target", draft=DEMO / "draft")
    assert isinstance(models, Models) and not models.drafting
    generate(models, "x = 1", num_draft="auto", max_tokens=10)
    (auto,) = models.drafting.values()
    judged = sum(auto.judged)
    generate(models, "y = 2", num_draft="auto", max_tokens=10)
    assert list(models.drafting.values()) == [auto] and sum(auto.judged) != judged
