"""Sampling: temperature, top-k and top-p as distributions, and seeds that make a run reproducible."""

import json

from checkpoints import PROMPT

import main
import mlx.core as mx
from conftest import ROOT
from generate import generate
from sampling import Sampling, logits_to_probs
from loading import load


def test_logits_to_probs_applies_temperature_top_k_and_top_p():
    logits = mx.log(mx.array([[0.5, 0.25, 0.15, 0.1]]))
    assert mx.allclose(logits_to_probs(logits, Sampling(temp=1.0)), mx.array([[0.5, 0.25, 0.15, 0.1]]))
    top_k = logits_to_probs(logits, Sampling(temp=1.0, top_k=2))
    assert mx.allclose(top_k, mx.array([[2 / 3, 1 / 3, 0, 0]]))
    # top_p=0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it.
    assert mx.allclose(logits_to_probs(logits, Sampling(temp=1.0, top_p=0.7)), top_k)
    assert mx.allclose(logits_to_probs(logits, Sampling(temp=1.0, top_p=0.1)), mx.array([[1.0, 0, 0, 0]]))
    hot = logits_to_probs(logits, Sampling(temp=1e6))
    assert mx.allclose(hot, mx.full((1, 4), 0.25), atol=1e-4)


def test_top_k_1_sampling_is_greedy(v1_1_checkpoint):
    models = load(v1_1_checkpoint.mlx_dir)
    assert generate(models, PROMPT, max_tokens=20, temp=3.0, top_k=1) == generate(models, PROMPT, max_tokens=20)


def test_a_seed_makes_sampling_reproducible_and_another_seed_varies_it():
    models = load(ROOT / "demo" / "target", draft=ROOT / "demo" / "draft")
    prompt = main.demo_prompts()[4]
    for speculative in (False, True):
        options = dict(temp=1.5, seed=3, max_tokens=30, speculative=speculative)
        first = generate(models, prompt, **options)
        assert first == generate(models, prompt, **options)
        assert first != generate(models, prompt, **{**options, "seed": 4})


def test_the_cli_seed_makes_a_run_reproducible(v1_1_checkpoint, capsys):
    def tokens(*seed):
        argv = ["--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "30", "--temp", "50", *seed]
        assert main.main([*argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    first = tokens("--seed", "1")
    assert first == tokens("--seed", "1") and first != tokens("--seed", "2")
