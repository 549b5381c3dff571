"""Rules in the slot (rules.py): a rule that reads the tokens before it, as Whisper's timestamp rule does, holds in
regular, drafted, looked-up and beam decoding as transformers' generate applies it as a logits processor, and
speculative sampling under it stays exact; transformers' bad_words_ids is such a rule."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
import torch
from support import chi_square_passes, decode, decode_batch, sampled
from transformers import LogitsProcessor, LogitsProcessorList

from loading import Models
from options import Settings
from plans import resolve
from rows import Request
from rules import BadWords, Rule

START, EOS = 0, 1


@dataclass(frozen=True)
class Pairs(Rule):
    """A toy of Whisper's timestamp rule: tokens from `first` on ("timestamps")
    come in pairs: after one alone, another or the end of text; after two in a
    row, no third."""

    first: int
    vocabulary: int
    looks_back = 2

    def banned(self, before):
        marked = [token >= self.first for token in before[-2:]]
        if marked == [True, True]:
            return range(self.first, self.vocabulary)
        if marked[-1:] == [True]:
            return [token for token in range(self.first) if token != EOS]
        return ()


def follows(rule: Pairs, start: int, tokens: list[int]) -> bool:
    return all(token not in set(rule.banned([start] + tokens[:i])) for i, token in enumerate(tokens))


class AsProcessor(LogitsProcessor):
    """A rule as transformers applies a logits processor: to each row's decoder ids so far."""

    def __init__(self, rule: Rule):
        self.rule = rule

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids.tolist()):
            banned = self.rule.banned(ids)
            scores[row, list(banned) if not isinstance(banned, range) else slice(banned.start, banned.stop)] = -float("inf")
        return scores


def theirs(hf_model, prompt: list[int], rule: Rule | None, max_tokens: int, **options) -> list[int]:
    processors = LogitsProcessorList([AsProcessor(rule)] if rule else [])
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, logits_processor=processors,
                                **({"num_beams": 1} | options))
    return [token for token in out[0, 1:].tolist() if token != EOS]


def test_a_rule_reading_earlier_tokens_decodes_as_transformers_regular_drafted_looked_up_and_in_beams(
        v1_1_checkpoint, pair):
    """The pair rule changes the greedy output and holds in it; regular
    decoding, drafts from the draft model and from the prompt (each checked
    at every verify position with the drafts before it) and 3-beam search
    each give what transformers' generate gives with the rule as a logits
    processor, alone and in a batch beside a row without the rule."""
    hf_model, prompt = v1_1_checkpoint.hf_model, v1_1_checkpoint.prompt_ids
    target = pair["target"]
    rule = Pairs(target.args.vocab_size // 2, target.args.vocab_size)
    expected = theirs(hf_model, prompt, rule, 40)
    plain = theirs(hf_model, prompt, None, 40)
    assert follows(rule, START, expected) and not follows(rule, START, plain), "the rule must change the output"
    assert sum(token >= rule.first for token in expected) >= 4, "the output must hold pairs for this to test anything"

    def ours(models, settings):
        request = Request(prompt, settings, rules=(rule,))
        tokens, _ = decode_batch(models, [request, Request(prompt, settings)], 2)
        return tokens

    for models, settings in ((Models(target), Settings(max_tokens=40, speculative=False)),
                             (Models(target, pair["drafts"]["close"]), Settings(max_tokens=40, num_draft=4)),
                             (Models(target, pair["drafts"]["unrelated"]), Settings(max_tokens=40, num_draft=3)),
                             (Models(target), Settings(max_tokens=40, num_draft=4, prompt_lookup=True))):
        with_rule, without = ours(models, settings)
        assert with_rule == expected and without == plain, settings
    beams = Settings(max_tokens=40, num_beams=3, speculative=False)
    with_rule, without = ours(Models(target), beams)
    assert with_rule == theirs(hf_model, prompt, rule, 40, num_beams=3) and follows(rule, START, with_rule)
    assert without == theirs(hf_model, prompt, None, 40, num_beams=3)


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_sampling_under_a_rule_reading_earlier_tokens_follows_the_target_distribution_with_it(tiny_vocab_pair, draft):
    """At temperature 1, drafted and verified (or looked up and verified),
    the token after a lone "timestamp" is distributed as the target's
    logits with what the rule bans there removed; every output keeps the rule."""
    (target, hf_target), (draft_model, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    rule = Pairs(4, 8)
    prompt = [0, 3, 5, 4, 3, 4, 0, 7, 1]
    models = Models(target, draft_model if draft == "model" else None)
    settings = Settings(max_tokens=4, temp=1.0, num_draft=3, prompt_lookup=draft == "lookup")
    mx.random.seed(7)
    outputs, totals = sampled(models, prompt, settings, rules=(rule,))
    assert 0.05 < totals.acceptance_rate < 0.95, "drafts must be both accepted and rejected for this to test anything"
    assert all(follows(rule, START, out) for out in outputs)
    firsts = np.bincount([out[0] if out else EOS for out in outputs], minlength=8)
    first = int(np.argmax(np.where(np.arange(8) >= rule.first, firsts, 0)))
    assert firsts[first] > 300, "a timestamp must often come first for this to test anything"
    seconds = np.bincount([out[1] if len(out) > 1 else EOS for out in outputs if out and out[0] == first], minlength=8)
    with torch.no_grad():
        logits = hf_target(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([[START, first]])).logits[0, -1]
    logits = logits.double().numpy()
    logits[list(rule.banned([START, first]))] = -np.inf
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert expected[[0, 2, 3]].sum() == 0 and chi_square_passes(seconds, expected), (seconds / seconds.sum(), expected)


def test_bad_words_are_transformers_no_bad_words_processor(v1_1_checkpoint, pair):
    """bad_words_ids, a sequence of one token and one of two, each never
    completed: regular, drafted and beam decoding as transformers' generate
    with bad_words_ids gives; the one-token ban reads nothing before it (a
    fixed ban on the device), the other the token before it."""
    hf_model, prompt = v1_1_checkpoint.hf_model, v1_1_checkpoint.prompt_ids
    plain = theirs(hf_model, prompt, None, 30)
    common = max(set(plain), key=plain.count)
    pair_of = next((a, b) for a, b in zip(plain, plain[1:]) if a != common and b != common)
    words = ((common,), pair_of)
    assert BadWords(words).looks_back == 1 and BadWords(((common,),)).looks_back == 0
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, num_beams=1,
                                bad_words_ids=[list(w) for w in words])
    expected = [token for token in out[0, 1:].tolist() if token != EOS]
    assert expected != plain and common not in expected
    for models, settings in ((Models(pair["target"]), Settings(max_tokens=30, speculative=False, bad_words_ids=words)),
                             (Models(pair["target"], pair["drafts"]["close"]), Settings(max_tokens=30, num_draft=4,
                                                                                          bad_words_ids=words))):
        assert decode(models, prompt, settings) == expected
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, num_beams=3,
                                bad_words_ids=[list(w) for w in words])
    beams = Settings(max_tokens=30, num_beams=3, speculative=False, bad_words_ids=words)
    assert decode(Models(pair["target"]), prompt, beams) == [t for t in out[0, 1:].tolist() if t != EOS]
    assert resolve(beams, Models(pair["target"])).settings.penalties.rules == (BadWords(words),)


@pytest.mark.parametrize("max_initial", [None, 4])
def test_whispers_timestamp_bans_on_the_device_are_its_rules_bans_at_every_prefix(max_initial):
    """Timestamps.banned (transformers' WhisperTimeStampLogitsProcessor's bans, on the host) is what the device
    computes (rules.timestamp_bans) for any tokens, at each of several prefixes as a verify pass asks, for rows of
    other lengths in one batch, padded on the left; a row without the rule bans nothing."""
    from rules import TimestampRows, Timestamps, mark

    vocabulary, first = 40, 24
    rng = np.random.default_rng(0)
    openings = [[30, 3, 4], [30, 3, 4, 22], [30, 5, 6]]  # (the second opens with a fourth token)
    rules = [(Timestamps(first, 22, 1, len(opening), vocabulary, max_initial),) for opening in openings[:2]] + [()]
    for trial in range(40):
        lengths, queries = [int(length) for length in rng.integers(0, 9, size=3)], int(rng.integers(1, 5))
        # Timestamps often, in runs and pairs, rising and falling: the rules' every branch.
        rows = [opening + [int(rng.integers(first, vocabulary)) if rng.random() < 0.5 else int(rng.integers(0, first))
                           for _ in range(length + queries - 1)] for opening, length in zip(openings, lengths)]
        width = max(len(row) for row in rows)
        tokens = mx.array([[-1] * (width - len(row)) + row for row in rows])
        positions = mx.array([[length + j for j in range(queries)] for length in lengths])
        device = np.array(TimestampRows(rules, vocabulary).bans(tokens, positions))
        for r, (row, row_rules, opening) in enumerate(zip(rows, rules, openings)):
            for j in range(queries):
                expected = np.zeros(vocabulary, bool)
                for rule in row_rules:
                    mark(expected, rule.banned(row[: len(opening) + lengths[r] + j]))
                assert (device[r, j] == expected).all(), (trial, r, j, row)
