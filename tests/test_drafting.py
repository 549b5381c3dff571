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
from support import chi_square_passes, decode, decode_batch, regular, sampled

import main
import mlx.core as mx
from rows import Request, Row, encode_for
from autodraft import AutoDraft, DraftCost, first_worth, worth
from drafting import DraftModel, PromptLookup
from errors import OptionError
from generate import generate
from interactive import Session
from loading import Learned, Models, load, load_model, load_tokenizer
from options import Settings, Stats
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
    out = decode(Models(target, pair["drafts"][draft]), prompt, Settings(max_tokens=64, num_draft="auto"), stats)
    assert out == regular(target, prompt, 64)
    assert out == reference_greedy(checkpoint.hf_model, prompt, 64)
    assert stats.drafted > 0


@pytest.mark.parametrize("num_draft", [1, 3, 8])
def test_greedy_prompt_lookup_equals_regular_and_transformers_greedy(pair, num_draft):
    target, checkpoint = pair["target"], pair["checkpoint"]
    prompt = checkpoint.prompt_ids
    out = decode(Models(target), prompt, Settings(max_tokens=64, num_draft=num_draft, prompt_lookup=True))
    assert out == regular(target, prompt, 64)
    assert out == reference_greedy(checkpoint.hf_model, prompt, 64)


@pytest.mark.parametrize("draft, num_draft", [("close", "auto"), (None, 4)])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_batched_auto_and_lookup_rows_equal_each_prompt_alone(pair, prompt_ids, draft, num_draft, batch_size):
    target = pair["target"]
    alone = [regular(target, prompt, 40) for prompt in prompt_ids]
    settings = Settings(max_tokens=40, num_draft=num_draft, prompt_lookup=draft is None)
    tokens, _ = decode_batch(Models(target, pair["drafts"][draft] if draft else None),
                             [Request(prompt, settings) for prompt in prompt_ids], batch_size)
    assert tokens == alone


@pytest.mark.parametrize("temp, top_p", [(1.0, 1.0), (1.0, 0.8)])
def test_sampling_with_looked_up_drafts_follows_the_target_distribution(tiny_vocab_pair, temp, top_p):
    """The target's most frequent first token, 0, occurs in the prompt
    followed by 7 (which the target gives about 15%), so after it the second
    token is a looked-up draft (q one-hot), accepted or resampled: the
    second token's distribution given that first token passes a chi-square
    test against the target's, and so does the first token's."""
    target, hf_target = tiny_vocab_pair["target"]
    prompt = [0, 3, 5, 4, 3, 4, 0, 7, 1]
    models, settings = Models(target), Settings(max_tokens=3, temp=temp, top_p=top_p, num_draft=1, prompt_lookup=True)
    mx.random.seed(4321)
    outputs, totals = sampled(models, prompt, settings)
    assert 0.05 < totals.acceptance_rate < 0.9, "looked-up drafts must be both accepted and rejected for this to test anything"
    firsts = np.bincount([out[0] if out else 1 for out in outputs], minlength=8)
    assert chi_square_passes(firsts, exact_first_token_distribution(hf_target, prompt, temp, top_p))
    first = int(np.argmax(np.where(np.arange(8) == 1, 0, firsts)))
    seconds = np.bincount([out[1] if len(out) > 1 else 1 for out in outputs if out and out[0] == first], minlength=8)
    assert chi_square_passes(seconds, exact_first_token_distribution(hf_target, prompt, temp, top_p, after=(first,)))


@pytest.mark.parametrize("temp, top_p", [(1.0, 1.0), (1.0, 0.8)])
def test_sampling_with_auto_follows_the_target_distribution(tiny_vocab_pair, temp, top_p, monkeypatch):
    """auto drafts as many tokens as the draft's confidences make worth it;
    the first token's distribution, and the second's given the most frequent
    first, are still the target's. (Every round drafts one at least here: on
    these tiny models a draft step costs a target step, so auto would seldom
    draft.)"""
    monkeypatch.setattr(AutoDraft, "idle_most", 0)
    (target, hf_target), (draft, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    prompt = [5, 3, 6, 1]
    models, settings = Models(target, draft), Settings(max_tokens=4, temp=temp, top_p=top_p, num_draft="auto")
    mx.random.seed(1234)
    outputs, totals = sampled(models, prompt, settings)
    assert 0.1 < totals.acceptance_rate < 0.9
    firsts = np.bincount([out[0] if out else 1 for out in outputs], minlength=8)
    assert chi_square_passes(firsts, exact_first_token_distribution(hf_target, prompt, temp, top_p))
    first = int(np.argmax(np.where(np.arange(8) == 1, 0, firsts)))
    seconds = np.bincount([out[1] if len(out) > 1 else 1 for out in outputs if out and out[0] == first], minlength=8)
    assert chi_square_passes(seconds, exact_first_token_distribution(hf_target, prompt, temp, top_p, after=(first,)))


class DropsTheSecond(AutoDraft):
    """Decides against the second draft every round, once it is made."""

    def decide(self, reach, rates, limits, made, cost):
        return False, False


def test_a_dropped_draft_leaves_the_draft_cache_as_one_draft_would(pair):
    """Dropping the late draft rolls the draft's cache back a position: every
    round then proposes what num-draft 1 proposes (a stale position would
    change the draft's next proposals, and so the counts)."""
    target, draft, prompt = pair["target"], pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    dropped, one = Stats(), Stats()
    models = Models(target, draft, learned=Learned(DropsTheSecond()))
    out = decode(models, prompt, Settings(max_tokens=40, num_draft="auto"), dropped)
    assert out == decode(Models(target, draft), prompt, Settings(max_tokens=40, num_draft=1), one)
    assert (dropped.drafted, dropped.accepted, dropped.target_calls) == (one.drafted, one.accepted, one.target_calls)


# ---------------------------------------------------------------- auto's rule


class Ticking:
    """A clock for auto's cost: each reading is `step` seconds after the last."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


AUTO = Settings(num_draft="auto")


def drafts_taken(auto: AutoDraft, draft, prompt: list[int]) -> int:
    """How many tokens auto drafts in one round from a fresh cache: the same confidences every time."""
    (cache,) = encode_for([draft], [prompt])
    drafter = DraftModel(draft, auto)
    row = Row(Request(prompt, AUTO), (0.0, 0.0), (0, 0))
    drafter.start(row, (draft.args.decoder_start_token_id,))
    return drafter.propose([row], [AutoDraft.cap], RowSampling([Sampling()]), None, cache).drafts.shape[1]


def learnt(rounds: list[tuple[int, int]], step: float = 0.001) -> AutoDraft:
    """An AutoDraft after rounds of (drafts, accepted), each at confidence 0.5
    and at the same speed (seconds in proportion to tokens: 100 a second),
    on a clock whose draft steps take `step` (a tenth of a token's time by
    default), as the rounds' steps did."""
    auto = AutoDraft(clock=Ticking(step))
    calibration, cost = auto.calibration(AUTO), auto.cost(1)
    cost.draft_step(step)
    for drafted, accepted in rounds:
        calibration.learn([([0.5] * drafted, accepted)])
        cost.round(1, drafted, accepted + 1, 0.01 * (accepted + 1))
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
    cheap, dear = learnt([(4, 3)] * 10), learnt([(4, 3)] * 10, step=0.005)
    assert drafts_taken(dear, draft, prompt) < drafts_taken(cheap, draft, prompt)


def test_auto_can_draft_a_single_token_a_round(pair):
    """Half the drafts pass: a second draft adds a quarter of a token. At a
    tenth of a token's time a draft, auto drafts it; at three tenths, it
    decides so before running the second draft's step: one draft a round."""
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    cheap, dear = learnt([(4, 1)] * 20), learnt([(4, 1)] * 20, step=0.003)
    assert drafts_taken(cheap, draft, prompt) >= 2
    assert drafts_taken(dear, draft, prompt) == 1


def test_auto_drafts_nothing_in_a_round_whose_first_draft_is_not_worth_its_cost(pair):
    """One draft in eleven passes: a first draft adds 0.09 tokens. At three tenths of a token's time a draft, auto
    drafts none (the round decodes as regular decoding does), until AutoDraft.idle_most rounds in a row have drafted
    nothing, when one drafts, so that what auto knows of the draft stays up to date; at a twentieth, it drafts."""
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    rejected = [(4, 0)] * 18 + [(4, 1)] * 2
    dear, cheap = learnt(rejected, step=0.003), learnt(rejected, step=0.0005)
    (cache,) = encode_for([draft], [prompt])
    drafter = DraftModel(draft, dear)
    row = Row(Request(prompt, AUTO), (0.0, 0.0), (0, 0))
    drafter.start(row, (draft.args.decoder_start_token_id,))
    taken = [drafter.propose([row], [AutoDraft.cap], RowSampling([Sampling()]), None, cache).drafts.shape[1]
             for _ in range(AutoDraft.idle_most + 1)]
    assert taken[:-1] == [0] * AutoDraft.idle_most and taken[-1] >= 1
    assert drafts_taken(cheap, draft, prompt) >= 1


def test_rounds_that_draft_only_to_keep_auto_current_come_half_as_often_where_no_draft_could_pay(pair):
    """Where a first draft costs more than a round of none makes (a CPU at a large batch), no acceptance could pay
    for it, and the rounds that draft regardless cost what they measure: each doubles the wait for the next, up to
    AutoDraft.idle_longest rounds; a round that drafts because it pays starts the count over. A draft that is merely
    often wrong is tried every AutoDraft.idle_most rounds, however long it has been wrong."""

    def gaps(first_draft_seconds: float) -> list[int]:
        auto = AutoDraft()
        drafter, cost = DraftModel(pair["drafts"]["close"], auto), auto.cost(1)
        cost.draft_step(0.001)
        for _ in range(DraftCost.trusted):
            for steps, seconds in [(0, 0.010), (1, 0.010 + first_draft_seconds), (2, 0.012 + first_draft_seconds)]:
                cost.round(1, steps, 1 + steps, seconds)
        drafted = [i for i in range(300) if drafter.drafts_now([0.09], [AutoDraft.cap], cost)]
        if first_draft_seconds > 0.010:
            assert drafter.drafts_now([1.0], [AutoDraft.cap], cost) is False  # not even a sure draft pays
        return [later - earlier - 1 for earlier, later in zip([-1] + drafted, drafted)]

    assert gaps(0.015) == [8, 16, 32, 64, 64, 64]
    assert set(gaps(0.002)) == {AutoDraft.idle_most}
    auto = AutoDraft()
    drafter, cost = DraftModel(pair["drafts"]["close"], auto), auto.cost(1)
    cost.idle_most = 64
    assert drafter.drafts_now([1.0], [AutoDraft.cap], AutoDraft().cost(1))  # nothing timed: half a token pays
    cost.draft_step(0.001)
    assert drafter.drafts_now([1.0], [AutoDraft.cap], cost) and cost.idle_most is None  # worth it: the count starts over


def test_greedy_auto_with_rounds_of_no_drafts_equals_regular(pair):
    """A draft that is rarely right and dear: most of auto's rounds draft nothing, and the output is regular
    decoding's, token for token."""
    target, checkpoint = pair["target"], pair["checkpoint"]
    models = Models(target, pair["drafts"]["unrelated"])
    models.learned.drafting = learnt([(4, 0)] * 18 + [(4, 1)] * 2, step=0.003)
    stats = Stats()
    out = decode(models, checkpoint.prompt_ids, Settings(max_tokens=64, num_draft="auto"), stats)
    assert out == regular(target, checkpoint.prompt_ids, 64)
    assert stats.drafted > 0 and stats.drafts_per_round < 0.5


def test_auto_stops_drafting_at_the_drafts_end_of_text(pair):
    """Tokens drafted after an end of text never reach the output: with the
    draft's first token made the end of text, auto keeps that one draft only,
    where it otherwise drafts several."""
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    confident = learnt([(4, 4)] * 20)
    cost = confident.cost(1)
    for _ in range(20):  # a draft: its step and as much again in the target's pass
        cost.round(1, 1, 1.4, 0.014)
        cost.round(1, 4, 2.6, 0.026)
    assert cost.per_draft(1) == pytest.approx(0.004)
    assert drafts_taken(confident, draft, prompt) >= 3
    (cache,) = encode_for([draft], [prompt])
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
    cost = DraftCost()
    cost.draft_step(0.001)
    for steps in [1, 4] * 10:
        cost.round(1, steps, steps + 1, 0.01 + 0.004 * steps)
    assert cost.per_draft(1) == pytest.approx(0.004)
    for _ in range(300):
        cost.round(1, 1, 2, 0.014)
    assert cost.per_draft(1) == pytest.approx(0.004)


def test_auto_measures_a_draft_cost_that_a_busy_machine_does_not_inflate():
    """A busy machine slows rounds down by some share of their time, never
    speeds them up: with a third of the rounds slowed by up to 3x, the cost
    of a draft stays where the quiet rounds put it (a slope through every
    round's seconds grows with the slowdowns)."""
    rng = random.Random(0)
    cost = DraftCost()
    cost.draft_step(0.001)
    for i in range(200):
        steps = 1 + i % 4
        slowdown = 1 + 2 * rng.random() if rng.random() < 1 / 3 else 1
        cost.round(1, steps, steps + 1, (0.01 + 0.002 * steps) * slowdown)
    assert cost.per_draft(1) == pytest.approx(0.002, rel=0.05)


def test_auto_does_not_price_drafts_by_one_slow_round():
    """A round length seen once may have met a new cache size (the model's
    steps then run plainly or trace): its time does not set the cost of a
    draft until DraftCost.trusted rounds of it were seen, or auto, finding a
    second draft dear, would never draft two again to learn otherwise."""
    cost = DraftCost()
    cost.draft_step(0.0005)
    for steps, seconds in [(1, 0.004)] * 20 + [(4, 0.020)]:
        cost.round(1, steps, steps + 1, seconds)
    assert cost.per_draft(1) == pytest.approx(0.0005)
    for _ in range(DraftCost.trusted - 1):
        cost.round(1, 4, 5, 0.0058)
    assert cost.per_draft(1) == pytest.approx(0.0006, rel=0.05)


def test_what_drafting_at_all_costs_is_a_round_of_one_drafts_floor_over_a_round_of_nones():
    """A round of no drafts skips the draft's call (and its catch-up on the tokens it has not seen): the first draft
    costs what separates rounds of one draft from rounds of none, and every later one the slope through the lengths
    that draft, which rounds of none do not bend."""
    cost = DraftCost()
    cost.draft_step(0.001, rows=4)
    for _ in range(DraftCost.trusted):
        for steps, seconds in [(0, 0.010), (1, 0.016), (2, 0.018), (3, 0.020), (4, 0.022)]:
            cost.round(4, steps, 4 + steps, seconds)
    assert cost.per_draft(4) == pytest.approx(0.002)
    assert cost.first_draft(4) == pytest.approx(0.006)
    assert DraftCost().first_draft(4) is None  # nothing timed yet


def test_rounds_of_ever_changing_row_counts_price_a_draft_for_the_rows_at_hand():
    """A server's row count changes from round to round, so few counts are seen DraftCost.trusted times: rounds of
    one size class (33 to 64 rows) count together, by a row's share, and a draft is priced for the round's rows. Where
    a verify pass costs in proportion to the positions it scores, as on a CPU at a large batch, a first draft then
    costs what a position of every row does, and a draft that the target accepts 8 times in 10 is not worth it
    (priced by the draft's step alone, as when no length was trusted, it was)."""
    rng = random.Random(0)
    auto = AutoDraft()
    cost = auto.cost(64)
    assert auto.cost(33) is cost and auto.cost(32) is not cost
    row_position, draft_row, a = 0.0004, 0.00002, 0.8  # a row's position in the target's pass, a row's draft step
    for i in range(60):
        rows, steps = rng.randint(33, 64), i % 5
        cost.draft_step(draft_row * rows, rows)
        cost.round(rows, steps, rows * (1 + a * steps), rows * (row_position * (1 + steps) + draft_row * steps))
    assert cost.per_draft(40) == pytest.approx(40 * (row_position + draft_row))
    assert cost.first_draft(40) == pytest.approx(40 * (row_position + draft_row))
    assert cost.no_drafts(40) == pytest.approx(40 * row_position)
    assert not first_worth([a] * 40, [4] * 40, cost)
    assert worth(a * 40, cost.step_seconds(40), cost.speed)


def test_rounds_kept_to_the_cap_try_one_draft_fewer_until_a_draft_has_a_price():
    """Priced by its step alone, a draft looks cheap, and rounds would keep to the cap, the one length they time:
    then they draft one fewer than the shortest length trusted, until the lengths span DraftCost.span_least drafts
    and their slope prices a draft (lengths a draft apart differ by their noise as much as by a draft). A slope below
    zero says the lengths timed are too close together for their noise: rounds then try a shorter one. Lengths that
    keep clear of the cap (a draft often wrong: rounds of 1 and 2) price a draft by their slope, however close."""
    cost = DraftCost()
    cost.draft_step(0.0001)
    cap = AutoDraft.cap
    for _ in range(DraftCost.trusted):
        assert cost.shorter(cap) is None
        cost.round(1, cap, cap + 1, 0.01 + 0.004 * cap)
    for shorter in range(cap - 1, cap - DraftCost.span_least - 1, -1):
        assert cost.shorter(cap) == shorter
        for _ in range(DraftCost.trusted):
            cost.round(1, shorter, shorter + 1, 0.01 + 0.004 * shorter)
    assert cost.shorter(cap) is None and cost.per_draft(1) == pytest.approx(0.004)
    noisy = DraftCost()  # floors that fall as lengths grow: too close together to price a draft
    for _ in range(DraftCost.trusted):
        for steps, seconds in [(5, 0.031), (6, 0.030), (7, 0.029), (8, 0.028)]:
            noisy.round(1, steps, steps + 1, seconds)
    assert noisy.slope < 0 and noisy.shorter(cap) == 4
    short = DraftCost()
    short.draft_step(0.0001)
    for _ in range(DraftCost.trusted):
        for steps in (1, 2):
            short.round(1, steps, steps + 1, 0.01 + 0.004 * steps)
    assert short.shorter(cap) is None and short.per_draft(1) == pytest.approx(0.004)


def test_a_round_drafts_one_fewer_than_the_cap_while_the_cap_is_the_one_length_timed(pair):
    draft, prompt = pair["drafts"]["close"], pair["checkpoint"].prompt_ids
    assert drafts_taken(learnt([(AutoDraft.cap, AutoDraft.cap)] * 10), draft, prompt) == AutoDraft.cap - 1
    priced = learnt([(AutoDraft.cap - k, AutoDraft.cap - k) for k in range(DraftCost.span_least + 1) for _ in range(10)])
    assert drafts_taken(priced, draft, prompt) == AutoDraft.cap


def test_rounds_whose_steps_did_not_replay_a_compiled_graph_are_timed_apart(pair):
    """The model says which steps ran a shape for the first time or traced
    it (EncoderDecoder.cold_steps): a fresh pair's first two rounds do, and
    auto's cost keeps them out of the floors of rounds that replayed, which
    price a length once they are trusted."""
    checkpoint = pair["checkpoint"]
    fresh = Models(load_model(checkpoint.mlx_dir), load_model(checkpoint.mlx_dir))
    stats = Stats()
    decode(fresh, checkpoint.prompt_ids, Settings(max_tokens=30, num_draft="auto"), stats)
    cost = fresh.learned.drafting.cost(1)
    every, replayed = (sum(count for _, count in floors.values()) for floors in (cost.every, cost.replayed))
    assert every == stats.target_calls > 2 and replayed <= every - 2


def test_a_length_is_priced_by_its_replayed_rounds_once_trusted_and_by_every_round_until_then():
    """Rounds that ran a step for the first time, or traced one, are slower than the next: they price a length only
    until DraftCost.trusted rounds of it replayed (a server's row count changes so often that few rounds do)."""
    cost = DraftCost()
    for _ in range(DraftCost.trusted):
        cost.round(1, 2, 3, 0.030, replayed=False)
    assert cost.floors[2] == [0.030, DraftCost.trusted]
    for n in range(1, DraftCost.trusted + 1):
        cost.round(1, 2, 3, 0.040)
        if n < DraftCost.trusted:  # every round's floor, which rises slowly
            assert cost.floors[2][1] == DraftCost.trusted + n and cost.floors[2][0] < 0.031
        else:
            assert cost.floors[2] == [0.040, DraftCost.trusted]


@pytest.mark.parametrize("compiled, cold", [(True, [1, 1, 0, 0]), (False, [1, 0, 0, 0])])
def test_a_shape_is_cold_on_its_first_run_and_compiled_on_its_trace(pair, compiled, cold):
    """Op by op a shape's first step may compile kernels; compiled, its first
    runs plainly and its second traces: those are cold, the rest replay."""
    model = load_model(pair["checkpoint"].mlx_dir)
    model.compiled = compiled
    seen = []
    for _ in range(4):
        (cache,) = encode_for([model], [pair["checkpoint"].prompt_ids])
        before = model.cold_steps
        model.decode(mx.array([[0, 5]]), cache)
        seen.append(model.cold_steps - before)
    assert seen == cold


def test_auto_reports_its_mean_drafts_per_round(pair):
    stats = Stats()
    decode(Models(pair["target"], pair["drafts"]["close"]), pair["checkpoint"].prompt_ids,
           Settings(max_tokens=30, num_draft="auto"), stats)
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
    out = decode(models, ids, Settings(max_tokens=20, num_draft=8, prompt_lookup=True), stats)
    assert out == regular(models.target, ids, 20)
    assert stats.accepted >= 3 and stats.draft_calls == 0


# ---------------------------------------------------------------- what cannot run


@pytest.mark.parametrize("argv, message", [
    (["--num-draft", "auto", "--regular-decode"], "--num-draft auto is for speculative decoding: drop --regular-decode"),
    (["--prompt-lookup", "--draft-model", "demo/draft"], "--prompt-lookup drafts without a draft model: drop --draft-model"),
    (["--prompt-lookup", "--regular-decode"], "--prompt-lookup is for speculative decoding: drop --regular-decode"),
    (["--prompt-lookup", "--num-draft", "auto"], "--num-draft auto follows a draft model's confidence"),
    (["--num-draft", "often"], "--num-draft must be an integer in [1, 64] or auto (got 'often')"),
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
    assert models.learned.drafting is None  # nothing learnt yet
    generate(models, "x = 1", num_draft="auto", max_tokens=10)
    assert isinstance(models.learned.drafting, AutoDraft)
    (calibration,) = models.learned.drafting.calibrations.values()
    judged = sum(calibration.judged)
    generate(models, "y = 2", num_draft="auto", max_tokens=10)
    assert list(models.learned.drafting.calibrations.values()) == [calibration] and sum(calibration.judged) != judged


def test_auto_keeps_each_settings_record_whatever_batch_its_rows_shared(pair, prompt_ids):
    """Rows at delta 0 and at delta 0.5 in one batch: each setting's
    calibration learns from its own rows' drafts only."""
    models = Models(pair["target"], pair["drafts"]["close"])
    exact, lenient = Settings(max_tokens=20, num_draft="auto"), Settings(max_tokens=20, num_draft="auto", delta=0.5)
    requests = [Request(prompt, exact if i % 2 else lenient) for i, prompt in enumerate(prompt_ids)]
    decode_batch(models, requests, 4)
    calibrations = models.learned.drafting.calibrations
    assert set(calibrations) == {(0.0, exact.sampling), (0.5, lenient.sampling)}
    for settings in (exact, lenient):
        rows = [r for r in requests if r.settings is settings]
        # each counts its rows' judged drafts (decayed): up to each row's first rejection
        assert 0 < sum(calibrations[(settings.delta, settings.sampling)].judged) <= sum(r.stats.drafted for r in rows)


def with_head(draft, tokens: list[int]):
    """The draft with a head that scores `tokens` alone (a frequency-ranked subset's, as FR-Spec's drafts have)."""
    from dataclasses import replace as replaced

    from mlx.utils import tree_flatten

    from model import EncoderDecoder

    narrowed = EncoderDecoder(replaced(draft.args, head_tokens=len(tokens)))
    narrowed.load_weights(tree_flatten(draft.parameters()) + [("head_ids", mx.array(tokens, mx.int32))])
    return narrowed.compile_decoding()


def test_a_draft_head_over_some_tokens_scores_them_as_the_full_head_and_never_proposes_the_rest(tiny_vocab_pair):
    draft = tiny_vocab_pair["draft"][0]
    narrowed, head = with_head(draft, [0, 3, 5, 7]), np.array([0, 3, 5, 7])
    prompt = mx.array([[5, 3, 6, 1]])
    full = np.array(draft.decode(mx.array([[0, 4]]), draft.make_cache(draft.encode(prompt))))
    scored = np.array(narrowed.decode(mx.array([[0, 4]]), narrowed.make_cache(narrowed.encode(prompt))))
    np.testing.assert_allclose(scored[..., head], full[..., head], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.delete(scored, head, axis=-1)).all()


@pytest.mark.parametrize("temp, top_p", [(0.0, 1.0), (1.0, 1.0)])
def test_a_draft_head_over_some_tokens_leaves_the_output_the_targets(tiny_vocab_pair, temp, top_p):
    """The draft proposes only the head's tokens (not 6, which the target's greedy output and its distribution
    have): greedy, the output is the target's own; sampled, the first token's and the second's distributions pass a
    chi-square test against the target's (q is zero off the head, and the residual max(p - q, 0) restores it)."""
    (target, hf_target), (draft, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    models, prompt = Models(target, with_head(draft, [0, 1, 2, 3, 4, 5, 7])), [5, 3, 6, 1]
    if temp == 0:
        for prompt in ([5, 3, 6, 1], [0, 3, 5, 4, 3, 4, 0, 7, 1], [2, 2, 6, 1]):
            stats = Stats()
            assert decode(models, prompt, Settings(max_tokens=30, num_draft=3), stats) == regular(target, prompt, 30)
            assert stats.accepted > 0
        return
    settings = Settings(max_tokens=4, temp=temp, top_p=top_p, num_draft=2)
    mx.random.seed(2468)
    outputs, totals = sampled(models, prompt, settings)
    assert 0.1 < totals.acceptance_rate < 0.9
    firsts = np.bincount([out[0] if out else 1 for out in outputs], minlength=8)
    assert firsts[6] > 0, "the target's token the draft cannot propose must be drawn too"
    assert chi_square_passes(firsts, exact_first_token_distribution(hf_target, prompt, temp, top_p))
    first = int(np.argmax(np.where(np.arange(8) == 1, 0, firsts)))
    seconds = np.bincount([out[1] if len(out) > 1 else 1 for out in outputs if out and out[0] == first], minlength=8)
    assert chi_square_passes(seconds, exact_first_token_distribution(hf_target, prompt, temp, top_p, after=(first,)))
