"""Our output against transformers': float32 greedy ids token for token, and bfloat16 within a stated tolerance."""

import warnings

import numpy as np
import pytest
import torch
import train
from checkpoints import PROMPT, reference_greedy
from transformers import T5ForConditionalGeneration

import convert
import main
import mlx.core as mx
from conftest import ROOT
from generate import stream_generate
from loading import load, load_model


def greedy(models, prompt: str, max_tokens: int):
    """Our greedy ids through the public API, and the last statistics."""
    responses = list(stream_generate(models, prompt, max_tokens=max_tokens, speculative=False))
    return [r.token for r in responses if r.token is not None], responses[-1].stats


def test_greedy_ids_equal_transformers_greedy(checkpoint):
    ids, stats = greedy(load(checkpoint.mlx_dir), PROMPT, 64)
    assert ids == reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 64)
    assert stats.generated == 64 and stats.draft_calls == stats.drafted == stats.accepted == 0
    assert stats.target_calls == 64 and stats.tokens_per_target_call == 1.0


def test_greedy_ids_equal_transformers_generate(checkpoint):
    if checkpoint.hf_model.config.num_decoder_layers > checkpoint.hf_model.config.num_layers:
        pytest.skip("transformers' generate() breaks when the decoder is deeper than the encoder")
    ids, _ = greedy(load(checkpoint.mlx_dir), PROMPT, 64)
    with torch.no_grad():
        generated = checkpoint.hf_model.generate(torch.tensor([checkpoint.prompt_ids]), max_new_tokens=64, do_sample=False,
                                                 num_beams=1)
    assert ids == [t for t in generated[0, 1:].tolist() if t != checkpoint.hf_model.config.eos_token_id]


# bfloat16 keeps 8 bits of mantissa: each logit of a bf16 model is off by up to
# about 1% of its position's largest logit, ours as transformers' own bf16 is
# (measured on the demo target: 0.5-0.9%, and 0.5-0.75% between transformers'
# bf16 and float32). The tolerance is twice that, and a greedy choice whose
# margin over the runner-up exceeds two tolerances cannot be flipped by it.
BF16_TOLERANCE = 0.02  # of each position's largest |logit|


@pytest.fixture(scope="module")
def bf16_demo_target(tmp_path_factory):
    """A trained model (the demo target), converted to bfloat16 by convert.py,
    and transformers' float32 and bfloat16 forms of it; with each held-out
    prompt's ids and float32 greedy output (24 tokens at most)."""
    root = tmp_path_factory.mktemp("bf16")
    convert.convert(str(ROOT / "demo" / "target"), root / "bf16", "bfloat16", force=False)
    hf_dir = train.save_hugging_face(load_model(ROOT / "demo" / "target"), ROOT / "demo" / "target", root / "hf")
    hf32 = T5ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    hf16 = T5ForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.bfloat16).eval()
    with warnings.catch_warnings():  # on the CPU path, that bf16 decodes slowly there
        warnings.simplefilter("ignore", RuntimeWarning)
        models = load(root / "bf16")
    prompts = main.demo_prompts()
    ids = [models.tokenizer.encode(p) for p in prompts]
    return models, hf32, hf16, prompts, ids, [reference_greedy(hf32, i, 24) for i in ids]


def teacher_forced(hf_model, ids, decoded) -> np.ndarray:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([[0] + decoded])).logits[0].float().numpy()


def test_bfloat16_logits_are_within_tolerance_of_transformers_bfloat16(bf16_demo_target):
    models, hf32, hf16, _, ids, references = bf16_demo_target
    target = models.target
    assert target.shared.weight.dtype == mx.bfloat16
    for prompt_ids, decoded in zip(ids, references):
        ours = target.decode(mx.array([[0] + decoded]), target.make_cache(target.encode(mx.array([prompt_ids]))))
        ours = np.array(ours[0].astype(mx.float32))
        theirs, exact = teacher_forced(hf16, prompt_ids, decoded), teacher_forced(hf32, prompt_ids, decoded)
        scale = np.abs(exact).max(axis=-1, keepdims=True)
        assert (np.abs(ours - theirs) / scale).max() < BF16_TOLERANCE
        assert (np.abs(ours - exact) / scale).max() < BF16_TOLERANCE


def test_bfloat16_greedy_choices_agree_wherever_rounding_cannot_flip_them(bf16_demo_target):
    """Greedy output in bf16 equals the float32 greedy output on every prompt
    whose every choice wins by more than two tolerances, and so does each
    choice that wins by that much, teacher-forced; the fixture must have
    such prompts and choices for the check to mean anything."""
    models, hf32, _, prompts, ids, references = bf16_demo_target
    safe_prompts, safe_choices, choices = 0, 0, 0
    for prompt, prompt_ids, decoded in zip(prompts, ids, references):
        exact = teacher_forced(hf32, prompt_ids, decoded)[: len(decoded)]
        top2 = np.sort(exact, axis=-1)[:, -2:]
        wide = (top2[:, 1] - top2[:, 0]) / np.abs(exact).max(axis=-1) > 2 * BF16_TOLERANCE
        ours, _ = greedy(models, prompt, 24)
        if wide.all():
            safe_prompts += 1
            assert ours == decoded, prompt
        target = models.target
        logits = target.decode(mx.array([[0] + decoded]), target.make_cache(target.encode(mx.array([prompt_ids]))))
        chosen = np.array(logits[0, : len(decoded)].argmax(-1))
        assert (chosen[wide] == np.array(decoded)[wide]).all(), prompt
        safe_choices, choices = safe_choices + wide.sum(), choices + len(decoded)
    assert safe_prompts >= 2 and safe_choices >= choices / 2, (safe_prompts, safe_choices, choices)
