"""Beam search: each prompt's beams equal to transformers' generate(num_beams=...) (tokens, and the scores it ranks
them by), alone or many prompts in one batch, with its length penalty, early stopping and the processors."""

import io
import json
import re

import pytest
import torch
from checkpoints import PROMPTS
from support import assert_as_near_as_transformers, in_float64

import main
from conftest import ROOT
from batches import batch_for, drive
from rows import Request
from errors import OptionError
from generate import batch_generate, generate
from interactive import Session
from loading import load
from options import Settings

SEARCHES = [dict(num_beams=4), dict(num_beams=3, length_penalty=2.0, early_stopping=True, num_return_sequences=3),
            dict(num_beams=4, length_penalty=0.5, early_stopping="never", num_return_sequences=2),
            dict(num_beams=4, no_repeat_ngram_size=2, repetition_penalty=1.3, min_tokens=8)]


def transformers_beams(checkpoint, prompts: list[list[int]], max_tokens: int, options: dict, model=None):
    """generate()'s returned sequences (tokens after the start token, up to and without EOS) and their scores, per
    prompt; the checkpoint's model's, or `model`'s."""
    hf_options = {("min_new_tokens" if name == "min_tokens" else name): value for name, value in options.items()}
    count = options.get("num_return_sequences", 1)
    longest = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (longest - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts])
    with torch.no_grad():
        out = (model or checkpoint.hf_model).generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                                      output_scores=True, return_dict_in_generate=True, **hf_options)
    eos = checkpoint.hf_model.config.eos_token_id
    sequences = []
    for row in out.sequences[:, 1:].tolist():
        sequences.append(row[: row.index(eos)] if eos in row else row)
    scores = out.sequences_scores.tolist()
    return [list(zip(sequences[i * count : (i + 1) * count], scores[i * count : (i + 1) * count])) for i in range(len(prompts))]


def outputs(models, prompts: list[list[int]], settings: Settings, batch_size: int) -> tuple[list, list[Request]]:
    requests = [Request(ids, settings) for ids in prompts]
    tokens = {id(r): [] for r in requests}
    for request, token, _ in drive(batch_for(models, settings, batch_size), requests):
        if token is not None:
            tokens[id(request)].append(token)
    return [tokens[id(r)] for r in requests], requests


def our_beams(models, prompts: list[list[int]], settings: Settings, batch_size: int):
    tokens, requests = outputs(models, prompts, settings, batch_size)
    for output, request in zip(tokens, requests):
        assert request.sequences[0][0] == output  # the row's output is its best beam
    return [[(tokens, score) for tokens, score, _ in request.sequences] for request in requests]


@pytest.mark.parametrize("options", SEARCHES, ids=["plain", "length_penalty+early", "never", "processors"])
def test_beam_search_equals_transformers_generate_alone_and_batched(unit_scale_checkpoint, options):
    """At unit scale, where the model is unsure enough for beams to find what greedy does not."""
    checkpoint = unit_scale_checkpoint
    if checkpoint.hf_model.config.num_decoder_layers > checkpoint.hf_model.config.num_layers:
        pytest.skip("transformers' generate() breaks when the decoder is deeper than the encoder")
    models = load(checkpoint.mlx_dir)
    prompts = [checkpoint.tokenizer(p).input_ids for p in PROMPTS[:4]]
    settings = Settings(max_tokens=30, speculative=False, **options)
    expected = [transformers_beams(checkpoint, [p], 30, options)[0] for p in prompts]
    exact = [transformers_beams(checkpoint, [p], 30, options, in_float64(checkpoint.hf_model))[0] for p in prompts]
    for batch_size in (1, 3):
        ours = our_beams(models, prompts, settings, batch_size)
        for mine, theirs, float64 in zip(ours, expected, exact):
            assert [tokens for tokens, _ in mine] == [tokens for tokens, _ in theirs] == [tokens for tokens, _ in float64]
            assert_as_near_as_transformers(*([s for _, s in beams] for beams in (mine, theirs, float64)), "beam scores")
    greedy, _ = outputs(models, prompts, Settings(max_tokens=30, speculative=False, **processors(options)), 4)
    assert any(beams[0][0] != tokens for beams, tokens in zip(expected, greedy)), "beams must find what greedy does not"


def processors(options: dict) -> dict:
    return {name: value for name, value in options.items()
            if name not in ("num_beams", "length_penalty", "early_stopping", "num_return_sequences")}


# ---------------------------------------------------------------- in the API and the tools


@pytest.fixture(scope="module")
def demo():
    return load(ROOT / "demo" / "target")


def test_the_api_returns_the_best_beams_and_generate_the_best_ones_text(demo):
    prompts = main.demo_prompts()[:2]
    generations = batch_generate(demo, prompts, max_tokens=20, num_beams=4, num_return_sequences=3)
    for prompt, generation in zip(prompts, generations):
        assert len(generation.beams) == 3 and generation.beams[0][0] == generation.text
        assert [s for _, s in generation.beams] == sorted((s for _, s in generation.beams), reverse=True)
        assert generate(demo, prompt, max_tokens=20, num_beams=4) == generation.text


@pytest.mark.parametrize("options, message", [
    (dict(prompt_lookup=True, num_draft=3), "does not take prompt lookup"),
    (dict(num_draft="auto"), "does not take num-draft auto"),
    (dict(temp=0.7), "does not take sampling"),
    (dict(logprobs=2), "does not take logprobs"),
    (dict(num_return_sequences=5), "num_return_sequences (5) is at most num_beams (4)"),
])
def test_beam_search_refuses_what_it_cannot_do_exactly(options, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        Settings(num_beams=4, **options)


def test_the_command_line_and_the_loop_search_with_beams(demo, capsys):
    prompt = main.demo_prompts()[3]
    expected = batch_generate(demo, [prompt], max_tokens=15, num_beams=3, num_return_sequences=2)[0]
    assert main.main(["--demo", "--json", "--prompt", prompt, "--max-tokens", "15", "--num-beams", "3",
                      "--num-return-sequences", "2", "--early-stopping", "false"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] == expected.text and [b["text"] for b in record["beams"]] == [t for t, _ in expected.beams]
    # every beam's tokens, as the best one's: its text decoded from them
    assert record["beams"][0]["tokens"] == record["tokens"] and record["beams"][1]["tokens"] != record["tokens"]
    assert [demo.tokenizer.decode(b["tokens"]) for b in record["beams"]] == [b["text"] for b in record["beams"]]
    assert main.main(["--demo", "--compare", "--num-beams", "3"]) == 2
    assert "--num-beams searches with the target alone" in capsys.readouterr().err
    out = io.StringIO()
    session = Session(demo, Settings(max_tokens=15, speculative=False), out=out)
    for command in (":num-beams 3", ":num-return-sequences 2", ":early-stopping never", ":length-penalty 0.5"):
        session.command(command)
    assert session.settings == Settings(max_tokens=15, speculative=False, num_beams=3, num_return_sequences=2,
                                        early_stopping="never", length_penalty=0.5)
    session.generate(prompt)
    assert "mode beam search, 3 beams" in out.getvalue() and "beam 2 (score -" in out.getvalue()
