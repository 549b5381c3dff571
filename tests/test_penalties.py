"""Penalties on what a row has output (repetition, presence, frequency, min_tokens, no-repeat n-grams), logit_bias
and stop token ids: each as transformers' processor or OpenAI's rule computes it, and composed with speculative
decoding as an exact rule."""

import io
import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import PROMPT
from support import chi_square_passes, decode, decode_batch, sampled
from transformers import MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

import main
from conftest import ROOT
from rows import Request
from generate import generate, stream_generate
from interactive import Session
from loading import Models, load
from options import Settings
from sampling import Penalties, RowPenalties, ngram_bans

START, EOS = 0, 1


def test_each_penalty_is_transformers_processor_or_openais_rule():
    """Random logits and outputs: repetition and min_tokens as transformers'
    processors give them (the decoder's start token counting as seen);
    presence and frequency as OpenAI documents them, on output tokens only."""
    rng = np.random.default_rng(0)
    vocab, rows = 50, 4
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    outputs = [list(rng.integers(0, vocab, n)) for n in (0, 3, 7, 12)]
    counts = np.stack([np.bincount(out, minlength=vocab) for out in outputs]).astype(np.float32)
    penalties = [Penalties(1.3, 0.4, 0.25, 5, bias=((3, -100.0), (7, 2.5))), Penalties(0.8),
                 Penalties(presence=-0.5, frequency=1.0), Penalties(min_tokens=12, bias=((EOS, 5.0),))]
    ours = RowPenalties(penalties, [START] * rows, EOS, vocab).apply(mx.array(logits)[:, None], mx.array(counts)[:, None],
                                                     mx.array([[len(out)] for out in outputs]))[:, 0]
    for row, (p, out) in enumerate(zip(penalties, outputs)):
        decoded = torch.tensor([[START, *out]])
        expected = torch.tensor(logits[row : row + 1])
        if p.repetition != 1:
            expected = RepetitionPenaltyLogitsProcessor(p.repetition)(decoded, expected)
        expected = expected.numpy()[0] - p.presence * (counts[row] > 0) - p.frequency * counts[row]
        for token, bias in p.bias:  # OpenAI's logit_bias: added
            expected[token] += bias
        if p.min_tokens:
            expected = MinNewTokensLengthLogitsProcessor(1, p.min_tokens, EOS)(decoded, torch.tensor(expected[None]))[0].numpy()
        np.testing.assert_allclose(np.array(ours[row]), expected, rtol=1e-6, atol=1e-6)


def test_min_tokens_holds_back_stop_token_ids_too():
    logits = mx.zeros((1, 1, 10))
    penalties = RowPenalties([Penalties(min_tokens=3, ends=(4, 6))], [START], EOS, 10)
    early = penalties.apply(logits, mx.zeros((1, 1, 10)), mx.array([[2]]))[0, 0]
    late = penalties.apply(logits, mx.zeros((1, 1, 10)), mx.array([[3]]))[0, 0]
    assert [i for i in range(10) if early[i].item() == -np.inf] == [EOS, 4, 6] and not mx.isinf(late).any()


def test_no_repeat_ngram_bans_are_transformers_processor_for_every_prefix_and_size():
    """Rows of several lengths (padded on the left) and sizes, each of the
    last three prefixes (a verify pass's positions): the tokens banned are
    those transformers' NoRepeatNGramLogitsProcessor bans."""
    rng = np.random.default_rng(1)
    vocab, queries, banned = 6, 3, []
    for trial in range(60):  # sizes past the rows' lengths too: early in an output, every n-gram is longer than it
        sizes = [int(n) for n in rng.integers(0, 7, 4)]
        rows = [[int(t) for t in rng.integers(0, vocab, rng.integers(queries, 16 if trial % 2 else 5))] for _ in sizes]
        longest = max(map(len, rows))
        tokens = mx.array([[-1] * (longest - len(row)) + row for row in rows])
        bans = np.array(ngram_bans(tokens, mx.array(sizes), max(sizes), queries, vocab))
        for r, (row, n) in enumerate(zip(rows, sizes)):
            for q in range(queries):
                prefix = row[: len(row) - (queries - 1 - q)]
                expected = np.zeros(vocab, bool)
                if n:
                    expected = NoRepeatNGramLogitsProcessor(n)(torch.tensor([prefix]), torch.zeros(1, vocab))[0].isinf().numpy()
                assert (bans[r, q] == expected).all(), (n, prefix)
        banned.append(bans.any())
    assert any(banned) and not all(banned)


def greedy(models, prompt: str, max_tokens: int, **options) -> list[int]:
    return [r.token for r in stream_generate(models, prompt, max_tokens=max_tokens, speculative=False, **options)
            if r.token is not None]


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.3, min_new_tokens=30), dict(no_repeat_ngram_size=2)],
                         ids=["repetition+min_tokens", "no_repeat_ngram"])
def test_greedy_with_processors_equals_transformers_generate(checkpoint, options):
    if checkpoint.hf_model.config.num_decoder_layers > checkpoint.hf_model.config.num_layers:
        pytest.skip("transformers' generate() breaks when the decoder is deeper than the encoder")
    models = load(checkpoint.mlx_dir)
    ours = {"min_tokens" if name == "min_new_tokens" else name: value for name, value in options.items()}
    ids = greedy(models, PROMPT, 40, **ours)
    with torch.no_grad():
        generated = checkpoint.hf_model.generate(torch.tensor([checkpoint.prompt_ids]), max_new_tokens=40, do_sample=False,
                                                 num_beams=1, **options)
    assert ids == [t for t in generated[0, 1:].tolist() if t != checkpoint.hf_model.config.eos_token_id]
    assert ids != greedy(models, PROMPT, 40)  # the processors changed something


@pytest.fixture(scope="module")
def pair():
    return load(ROOT / "demo" / "target", draft=ROOT / "demo" / "draft")


PENALTIES = [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.5), dict(min_tokens=25),
             dict(repetition_penalty=0.9, frequency_penalty=-0.3), dict(logit_bias={2099: -100, 3: 4.0}),
             dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=5, repetition_penalty=1.2),
             dict(stop_token_ids=[3]), dict(stop_token_ids=[3], min_tokens=20)]


@pytest.mark.parametrize("options", PENALTIES, ids=["repetition", "presence+frequency", "min_tokens", "negative", "logit_bias",
                                                     "no_repeat_2", "no_repeat_5+repetition", "stop_token_ids",
                                                     "stop_token_ids+min_tokens"])
def test_speculative_decoding_with_penalties_equals_regular_decoding_with_them(pair, options):
    """Greedy, delta 0: each verify position is penalized for the output and
    the drafts before it, so every drafter and num-draft gives regular decoding's text."""
    changed = 0
    for prompt in main.demo_prompts()[:3]:
        regular = generate(pair, prompt, max_tokens=40, speculative=False, **options)
        changed += regular != generate(pair, prompt, max_tokens=40, speculative=False)
        for drafting in (dict(num_draft=1), dict(num_draft=4), dict(num_draft="auto"), dict(prompt_lookup=True, num_draft=3)):
            assert generate(pair, prompt, max_tokens=40, delta=0, **drafting, **options) == regular, drafting
    assert changed, "the penalties must change some answer for this to test anything"


def test_rows_with_and_without_penalties_share_a_batch_and_each_gets_its_own(pair):
    prompts = [pair.tokenizer.encode(p) for p in main.demo_prompts()[:4]]
    settings = [Settings(max_tokens=30, **options) for options in ({}, PENALTIES[0], PENALTIES[5], PENALTIES[7])]
    alone = [decode(pair, ids, s) for ids, s in zip(prompts, settings)]
    for speculative in (False, True):
        requests = [Request(ids, replace(s, speculative=speculative)) for ids, s in zip(prompts, settings)]
        tokens, _ = decode_batch(pair, requests, batch_size=4)
        assert tokens == alone, speculative


@pytest.mark.parametrize("processors", ["penalties", "no_repeat"])
@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_sampling_with_penalties_follows_the_penalized_target_distribution(tiny_vocab_pair, draft, processors):
    """At temperature 1, the second token given the most frequent first is
    distributed as the target's logits after that first token's penalties (or
    with the start token and the first banned, no_repeat_ngram_size 1):
    drafted and verified, or looked up and verified."""
    (target, hf_target), (draft_model, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    prompt = [0, 3, 5, 4, 3, 4, 0, 7, 1]
    models = Models(target, draft_model if draft == "model" else None)
    options = dict(repetition_penalty=2.0, presence_penalty=0.7) if processors == "penalties" else dict(no_repeat_ngram_size=1)
    settings = Settings(max_tokens=3, temp=1.0, num_draft=2, prompt_lookup=draft == "lookup", **options)
    mx.random.seed(99)
    outputs, totals = sampled(models, prompt, settings)
    assert 0.05 < totals.acceptance_rate < 0.95, "drafts must be both accepted and rejected for this to test anything"
    firsts = np.bincount([out[0] if out else EOS for out in outputs], minlength=8)
    first = int(np.argmax(np.where(np.arange(8) == EOS, 0, firsts)))
    seconds = np.bincount([out[1] if len(out) > 1 else EOS for out in outputs if out and out[0] == first], minlength=8)
    decoded = torch.tensor([[START, first]])
    with torch.no_grad():
        logits = hf_target(input_ids=torch.tensor([prompt]), decoder_input_ids=decoded).logits[:, -1].double()
    if processors == "penalties":
        logits = RepetitionPenaltyLogitsProcessor(2.0)(decoded, logits)
        logits[0, first] -= 0.7
    else:
        logits = NoRepeatNGramLogitsProcessor(1)(decoded, logits)
    logits = logits[0].numpy()
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert chi_square_passes(seconds, expected), (seconds / seconds.sum(), expected)


PROCESSORS = dict(no_repeat_ngram_size=2, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, min_tokens=5,
                  stop_token_ids=(3,), logit_bias={2099: -100})
FLAGS = ["--no-repeat-ngram-size", "2", "--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.2",
         "--min-tokens", "5", "--stop-token-ids", "3", "--logit-bias", "2099=-100"]
COMMANDS = [":no-repeat-ngram-size 2", ":repetition-penalty 1.3", ":presence-penalty 0.5", ":frequency-penalty 0.2",
            ":min-tokens 5", ":stop-token-ids 3", ":logit-bias 2099=-100"]


def test_the_command_line_takes_every_processor_as_the_api_does(pair, capsys):
    prompt = main.demo_prompts()[1]
    api = generate(pair, prompt, max_tokens=30, delta=0, num_draft=3, **PROCESSORS)
    assert api != generate(pair, prompt, max_tokens=30, delta=0, num_draft=3)
    assert main.main(["--demo", "--json", "--max-tokens", "30", "--delta", "0", "--prompt", prompt, *FLAGS]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == api
    assert main.main(["--demo", "--logit-bias", "7"]) == 2
    assert "--logit-bias takes ID=BIAS[,ID=BIAS...] (got '7')" in capsys.readouterr().err


def test_the_loop_has_a_command_for_every_processor_and_clears_a_list_with_none(pair):
    out = io.StringIO()
    session = Session(pair, Settings(max_tokens=30), out=out)
    for command in COMMANDS + [":stop xyz"]:
        session.command(command)
    assert session.settings == Settings(max_tokens=30, stop=("xyz",), **PROCESSORS)
    assert "stop-token-ids (3,)" in out.getvalue() and "stop 'xyz'" in out.getvalue()
    session.command(":stop-token-ids none")
    session.command(":stop none")
    assert session.settings.stop_token_ids == () and session.settings.stop == ()
    session.command(":stop-token-ids three")
    assert ":stop-token-ids takes ID[,ID...] (got 'three')" in out.getvalue()


def test_the_loop_shows_logprobs_and_n_outputs(pair):
    out = io.StringIO()
    session = Session(pair, Settings(max_tokens=6, speculative=False), out=out)
    session.command(":logprobs 2")
    session.generate(main.demo_prompts()[0])
    assert "token            logprob   most likely" in out.getvalue()
    session.command(":logprobs none")
    session.command(":n 2")
    session.command(":temp 1")
    session.generate(main.demo_prompts()[0])
    assert "--- prompt 1 of 1, output 2 of 2" in out.getvalue()
