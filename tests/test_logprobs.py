"""Logprobs: the target's own log-probabilities of each output token (raw: before processors and temperature, as
vLLM gives them by default) and of its most likely alternatives, the same whichever path decided the token."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import PROMPT
from support import assert_as_near_as_transformers, decode_batch, in_float64

import main
from conftest import ROOT
from rows import Request, encode_for
from generate import batch_generate, stream_generate
from loading import load
from options import Settings


def with_logprobs(models, prompt: str, **options):
    responses = [r for r in stream_generate(models, prompt, **options) if r.token is not None]
    return [r.token for r in responses], [r.logprob for r in responses]


def test_logprobs_are_the_models_log_softmax_before_processors(unit_scale_checkpoint):
    """Each token's logprob and its alternatives, against transformers'
    forward on the same tokens in float64 (as near as its float32 comes),
    with a repetition penalty on (which changes the tokens chosen, not the
    logprobs given)."""
    checkpoint = unit_scale_checkpoint
    models = load(checkpoint.mlx_dir)
    tokens, logprobs = with_logprobs(models, PROMPT, max_tokens=12, speculative=False, logprobs=5, repetition_penalty=1.5)
    with torch.no_grad():
        theirs, exact = (torch.log_softmax(model(input_ids=torch.tensor([checkpoint.prompt_ids]),
                                                 decoder_input_ids=torch.tensor([[0] + tokens[:-1]])).logits[0], -1).numpy()
                         for model in (checkpoint.hf_model, in_float64(checkpoint.hf_model)))
    positions, scale = np.arange(len(tokens)), np.abs(exact).max()
    assert_as_near_as_transformers([lp for lp, _ in logprobs], theirs[positions, tokens], exact[positions, tokens],
                                   "logprobs", scale)
    for _, top in logprobs:
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True) and len(top) == 5
    top_five = np.sort(theirs)[:, ::-1][:, :5], np.sort(exact)[:, ::-1][:, :5]
    assert_as_near_as_transformers([[lp for _, lp in top] for _, top in logprobs], *top_five, "top logprobs", scale)


@pytest.fixture(scope="module")
def pair():
    return load(ROOT / "demo" / "target", draft=ROOT / "demo" / "draft")


@pytest.mark.parametrize("drafting", [dict(num_draft=1), dict(num_draft=4), dict(num_draft="auto"),
                                      dict(prompt_lookup=True, num_draft=3)], ids=["1", "4", "auto", "lookup"])
def test_speculative_decodings_logprobs_equal_regular_decodings(pair, drafting):
    """Drafted or not, a token's logprobs are the target's at its position:
    verify computes them for every position it scores."""
    for prompt in main.demo_prompts()[:3]:
        tokens, regular = with_logprobs(pair, prompt, max_tokens=30, speculative=False, logprobs=3)
        drafted_tokens, drafted = with_logprobs(pair, prompt, max_tokens=30, delta=0, logprobs=3, **drafting)
        assert drafted_tokens == tokens
        np.testing.assert_allclose([lp for lp, _ in drafted], [lp for lp, _ in regular], atol=1e-4)
        for (_, ours), (_, theirs) in zip(drafted, regular):
            assert [t for t, _ in ours] == [t for t, _ in theirs]
            np.testing.assert_allclose([v for _, v in ours], [v for _, v in theirs], atol=1e-4)


def test_sampled_tokens_logprobs_do_not_follow_the_temperature_or_the_penalties(pair):
    """Raw logprobs: sampled at temperature 1.5 with penalties, drafted and
    verified, each token's logprob is the target's log-softmax after the
    tokens before it, scored in one teacher-forced pass."""
    prompt = main.demo_prompts()[0]
    ids = pair.tokenizer.encode(prompt)
    tokens, sampled = with_logprobs(pair, prompt, max_tokens=25, temp=1.5, seed=3, logprobs=0, num_draft=3,
                                    presence_penalty=1.0, no_repeat_ngram_size=2)
    target = pair.target
    cache = encode_for([target], [ids])[0]
    logits = target.decode(mx.array([[target.args.decoder_start_token_id] + tokens[:-1]]), cache)[0].astype(mx.float32)
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    np.testing.assert_allclose([lp for lp, _ in sampled], expected[np.arange(len(tokens)), tokens], atol=1e-4)
    assert len(set(tokens)) > 5


def test_rows_asking_for_logprobs_and_not_share_a_batch(pair):
    prompts = [pair.tokenizer.encode(p) for p in main.demo_prompts()[:4]]
    settings = [Settings(max_tokens=20, logprobs=n) for n in (None, 0, 5, 2)]
    for speculative in (False, True):
        requests = [Request(ids, replace(s, speculative=speculative)) for ids, s in zip(prompts, settings)]
        tokens, _ = decode_batch(pair, requests, batch_size=4)
        assert requests[0].logprobs == []
        for request, ids, n in zip(requests[1:], tokens[1:], (0, 5, 2)):
            assert len(request.logprobs) == len(ids) and all(len(top) == n for _, top in request.logprobs)
    generations = batch_generate(pair, main.demo_prompts()[:2], max_tokens=10, logprobs=1)
    assert [len(g.logprobs) for g in generations] == [len(g.tokens) for g in generations]


def test_the_command_line_prints_logprobs_as_the_api_gives_them(pair, capsys):
    prompt = main.demo_prompts()[2]
    _, expected = with_logprobs(pair, prompt, max_tokens=8, speculative=False, logprobs=2)
    assert main.main(["--demo", "--json", "--prompt", prompt, "--max-tokens", "8", "--regular-decode", "--logprobs", "2"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [(e["logprob"], [tuple(t) for t in e["top"]]) for e in record["logprobs"]] == expected
    assert main.main(["--demo", "--prompt", prompt, "--max-tokens", "8", "--regular-decode", "--logprobs", "2"]) == 0
    table = capsys.readouterr().out
    assert "token            logprob   most likely" in table and f"{expected[1][0]:8.3f}" in table


@pytest.mark.parametrize("many", ["n", "prompts-file"])
def test_every_output_of_a_batch_shows_its_logprobs_at_a_terminal(tmp_path, capsys, many):
    """--n 2, or two prompts from a file: each output's table under its text, as --json gives them."""
    prompts = main.demo_prompts()[:2]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    argv = ["--demo", "--max-tokens", "6", "--regular-decode", "--logprobs", "1"]
    argv += ["--prompt", prompts[0], "--n", "2"] if many == "n" else ["--prompts-file", str(tmp_path / "prompts.txt")]
    assert main.main(argv) == 0
    shown = capsys.readouterr().out
    assert main.main(argv + ["--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert shown.count("token            logprob   most likely") == len(records) == 2
    for record in records:
        assert all(f"{entry['logprob']:8.3f}" in shown for entry in record["logprobs"])
