"""demo/train.py: T5's span corruption and a training loop that learns."""

import itertools

import numpy as np
import pytest

import mlx.core as mx
import train
from model import EncoderDecoder, ModelArgs

SENTINELS = list(range(1099, 999, -1))  # <extra_id_0> is the last id, as in T5 tokenizers
EOS = 1


@pytest.mark.parametrize("seed", range(20))
def test_noise_mask_has_t5s_exact_counts_and_starts_spans_only_at_words(seed):
    rng = np.random.default_rng(seed)
    can_start = rng.random(train.RAW_LENGTH) < 0.4  # about code's share of word-start pieces
    mask = train.noise_mask(can_start, rng)
    noise = round(train.RAW_LENGTH * train.NOISE_DENSITY)
    spans = round(noise / train.MEAN_SPAN)
    assert mask.sum() == noise and not mask[0] and not mask[-1]
    starts = np.flatnonzero(mask[1:] & ~mask[:-1]) + 1
    assert len(starts) == spans
    assert can_start[starts].all()


def test_noise_mask_without_enough_word_starts_falls_back_to_plain_t5_spans():
    for words in [[], [train.RAW_LENGTH - 1]]:  # none; only one, too near the end for a span
        can_start = np.zeros(train.RAW_LENGTH, dtype=bool)
        can_start[words] = True
        mask = train.noise_mask(can_start, np.random.default_rng(0))
        assert mask.sum() == round(train.RAW_LENGTH * train.NOISE_DENSITY) and not mask[0]


def test_noise_mask_places_spans_anywhere_in_the_text_as_t5_does():
    rng = np.random.default_rng(0)
    masks = [train.noise_mask(rng.random(train.RAW_LENGTH) < 0.4, rng) for _ in range(300)]
    first = min(np.flatnonzero(m)[0] for m in masks)
    last = max(np.flatnonzero(m)[-1] for m in masks)
    assert first <= 3 and last >= train.RAW_LENGTH - 3  # not crowded at one end


def several_spans(length: int) -> np.ndarray:
    mask = np.zeros(length, dtype=bool)
    for start, stop in [(3, 6), (10, 11), (20, 25), (length - 4, length)]:
        mask[start:stop] = True
    return mask


@pytest.mark.parametrize("make_mask", ["noise_mask", "several spans"])
def test_corrupted_input_and_target_put_back_together_give_the_original(make_mask):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 999, train.RAW_LENGTH)
    if make_mask == "noise_mask":
        mask = train.noise_mask(rng.random(train.RAW_LENGTH) < 0.4, rng)
    else:
        mask = several_spans(train.RAW_LENGTH)
    inputs, targets = train.corrupt(ids, mask, SENTINELS, EOS)
    assert inputs[-1] == targets[-1] == EOS
    spans, current = {}, None
    for token in targets[:-1]:
        if token in SENTINELS:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    restored = list(itertools.chain.from_iterable(spans[t] if t in SENTINELS else [t] for t in inputs[:-1]))
    assert restored == ids.tolist()
    assert [t for t in targets if t in SENTINELS] == SENTINELS[: len(spans)]


@pytest.mark.parametrize("seed", range(5))
def test_every_example_has_the_same_shapes_so_one_compiled_step_serves_all(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 999, train.RAW_LENGTH)
    inputs, targets = train.corrupt(ids, train.noise_mask(rng.random(train.RAW_LENGTH) < 0.4, rng), SENTINELS, EOS)
    noise = round(train.RAW_LENGTH * train.NOISE_DENSITY)
    spans = round(noise / train.MEAN_SPAN)
    assert (len(inputs), len(targets)) == (train.RAW_LENGTH - noise + spans + 1, noise + spans + 1)


def test_training_lowers_the_loss_on_what_it_sees(monkeypatch):
    monkeypatch.setattr(train, "BATCH", 16)  # (a quarter of the demo's batch: the loss falls as far, four times as fast)
    args = ModelArgs(vocab_size=1100, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=2, num_decoder_layers=2)
    model = EncoderDecoder(args)
    train.initialize(model, seed=0)
    rng = np.random.default_rng(0)
    pieces = rng.integers(3, 999, (train.BATCH, train.RAW_LENGTH)).astype(np.int32)
    batch = next(train.batches(pieces, np.ones(1100, dtype=bool), rng, SENTINELS, EOS))
    before = train.loss_fn(model, *batch).item()
    history = train.train(model, itertools.repeat(batch), [batch], steps=60, log=lambda line: None)
    assert history[-1]["heldout_loss"] < 0.7 * before
    assert np.isfinite([h["train_loss"] for h in history]).all()


def test_a_student_trained_on_a_teachers_predictions_comes_to_agree_with_it(monkeypatch):
    """Distillation: the draft learns what the target predicts, not the text,
    so their argmax agree, which is what speculative decoding accepts. The
    teacher learned other text, so a student of the text itself disagrees.
    Batches of 16, a quarter of the demo's, four times as fast (agreement 0.97
    against the text's 0.07)."""
    monkeypatch.setattr(train, "BATCH", 16)
    small = dict(vocab_size=1100, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=1)
    teacher = EncoderDecoder(ModelArgs(d_model=64, d_ff=128, **small))
    student, control = (EncoderDecoder(ModelArgs(d_model=32, d_ff=64, **small)) for _ in range(2))
    for model, seed in ((teacher, 1), (student, 2), (control, 2)):
        train.initialize(model, seed=seed)
    rng = np.random.default_rng(0)
    teachers_text, text = (next(train.batches(rng.integers(3, 999, (train.BATCH, train.RAW_LENGTH)).astype(np.int32),
                                              np.ones(1100, dtype=bool), rng, SENTINELS, EOS)) for _ in range(2))
    quiet = lambda line: None  # noqa: E731
    train.train(teacher, itertools.repeat(teachers_text), [teachers_text], steps=60, log=quiet)
    before = train.agreement(student, teacher, [text])  # an untrained v1.0 T5 echoes its input
    history = train.train(student, itertools.repeat(text), [text], steps=200, log=quiet, teacher=teacher)
    train.train(control, itertools.repeat(text), [text], steps=60, log=quiet)
    distilled, learned_text = history[-1]["heldout_agreement"], train.agreement(control, teacher, [text])
    assert before < 0.2 and distilled > 0.8 and learned_text < distilled - 0.3, (before, distilled, learned_text)
    assert distilled == train.agreement(student, teacher, [text])


def test_initialisation_follows_t5():
    args = ModelArgs(vocab_size=1100, d_model=64, d_kv=16, d_ff=256, num_heads=4, num_layers=1, num_decoder_layers=1)
    model = EncoderDecoder(args)
    train.initialize(model, seed=0)
    layer = model.encoder.layers[0]
    assert abs(model.shared.weight.std().item() - 1.0) < 0.05
    assert abs(layer.attention.q.weight.std().item() - (64 * 16) ** -0.5) < 0.01
    assert abs(layer.ffn.wo.weight.std().item() - 256**-0.5) < 0.01
    assert mx.all(layer.attention_norm.weight == 1).item()
