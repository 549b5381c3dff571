"""demo/train_speech.py: speech windows labelled as Whisper is trained, features as transformers computes them, and
checkpoints that convert.py and the decoding rules take as an English-only Whisper."""

import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

import convert
import train_speech as ts
from loading import Models, load_model, read_generation_config
from speech_tokens import Whisper

SENTENCES = ["Return a list of folder names.", "Seek to the given position, then read the chunk.",
             "Delete all breakpoints in the file.", "The default value is determined at construction time."]


@pytest.fixture(scope="module")
def tokenizer():
    return ts.make_tokenizer(SENTENCES * 20)


def windows(tokenizer, seed=0) -> ts.Windows:
    """Clips of 1.5 to 9 s of a tone, each standing for one of SENTENCES (onsets are easy to find in a tone)."""
    rng, pieces, clips, offset = np.random.default_rng(seed), [], [], 0
    for i in range(12):
        length = int(rng.uniform(1.5, 9) * ts.RATE)
        pieces.append(0.5 * np.sin(np.arange(length) * 0.2).astype(np.float32))
        clips.append((i % len(SENTENCES), offset, length))
        offset += length
    return ts.Windows(torch.from_numpy(np.concatenate(pieces)), clips, SENTENCES, tokenizer, "cpu", seed)


def test_features_are_transformers_log_mel_within_1e_4(tokenizer):
    audio = np.random.default_rng(0).standard_normal(ts.WINDOW).astype(np.float32) * 0.1
    audio[: ts.RATE * 10] *= 0.01  # a quiet stretch, where the clamp below the loudest value acts
    ours = windows(tokenizer).features(torch.from_numpy(audio)[None])[0].numpy()
    theirs = WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=ts.RATE, return_tensors="np").input_features[0]
    assert ours.shape == theirs.shape == (80, 3000)
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.parametrize("seed", range(5))
def test_a_windows_labels_follow_whispers_rules_and_mark_where_each_sentence_is_heard(tokenizer, seed):
    """Timestamped windows: a pair of timestamps around each whole sentence, rising, the first within 1 s (the
    largest first timestamp decoding allows), each at the sample where its clip starts or ends; a sentence the window
    cuts ends the labels with its start alone. Windows without timestamps: the sentences' text alone."""
    made = windows(tokenizer, seed)
    first_time, text = made.first_time, {tuple(ids): i for i, ids in enumerate(made.text)}
    seen_cut = seen_plain = 0
    for _ in range(40):
        audio = torch.zeros(ts.WINDOW)
        tokens = made.window(audio)
        assert tokens[0] == made.start and tokens[-1] == made.end
        body = tokens[1:-1]
        if body and body[0] == made.none:  # whole sentences, one after another
            seen_plain += 1
            rest = body[1:]
            while rest:
                sentence = next(ids for ids in made.text if tuple(rest[:len(ids)]) == tuple(ids))
                rest = rest[len(sentence):]
            continue
        times = [i for i, token in enumerate(body) if token >= first_time]
        seconds = [(body[i] - first_time) * ts.STEP for i in times]
        assert seconds == sorted(seconds) and seconds[0] <= 1.0
        heard = (audio != 0).numpy()
        for start, end in zip(times[0::2], times[1::2]):
            assert tuple(body[start + 1:end]) in text  # a whole sentence between its pair
            begin, finish = round(seconds[times.index(start)] * ts.RATE), round(seconds[times.index(end)] * ts.RATE)
            assert heard[min(ts.WINDOW - 1, begin + 200)] and not heard[max(0, begin - 400)]
            assert heard[finish - 400] and not heard[min(ts.WINDOW - 1, finish + 200)]
        if len(times) % 2:  # a cut sentence: its start, then the end of text, and sound to the window's end
            seen_cut += 1
            assert times[-1] == len(body) - 1 and heard[-1]
    assert seen_cut and seen_plain


def test_held_out_sentences_are_a_tenth_chosen_by_the_sha1_of_their_text():
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(SENTENCES[0].split()) for _ in range(8)) + str(i) for i in range(5000)]
    share = sum(map(ts.held_out, sentences)) / len(sentences)
    assert 0.08 < share < 0.12
    # SHA-1 first bytes 12 and 16 (held out), 123 and 216 (not): on any machine, in any run
    assert ts.held_out("Write bytes to the file.") and ts.held_out("Create a new thread.")
    assert not ts.held_out("Return a list of folder names.") and not ts.held_out("Delete all breakpoints in the file.")


def test_word_error_rate_counts_substitutions_insertions_and_deletions_over_the_reference():
    assert ts.word_error_rate(["Return a list."], [" return a list"]) == 0
    assert ts.word_error_rate(["a b c d"], ["a x c"]) == 2 / 4  # one substituted, one deleted
    assert ts.word_error_rate(["a b", "c d"], ["a b e", ""]) == 3 / 4
    assert ts.word_error_rate(["one-time 2 pads"], ["one time two pads"]) == 1 / 4  # hyphens split, digits words


def test_speech_is_espeak_ngs_at_16_khz_with_its_silence_trimmed():
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng (a Debian package, which CI installs) speaks the training sentences")
    samples = ts.speak(SENTENCES[0], "en-us+f3", 170, 50)
    said = subprocess.run(["espeak-ng", "-v", "en-us+f3", "-s", "170", "-p", "50", "--stdout", SENTENCES[0]],
                          capture_output=True, check=True).stdout
    spoken = np.frombuffer(said[44:], "<i2")  # 22,050 Hz
    loud = np.flatnonzero(np.abs(spoken) > 0.02 * np.abs(spoken).max())
    assert samples.dtype == np.float32
    assert abs(len(samples) - (loud[-1] + 1 - loud[0]) * ts.RATE / 22_050) < 0.01 * ts.RATE
    peak = np.abs(samples).max()
    assert np.abs(samples[:40]).max() > 0.02 * peak * 0.5 and np.abs(samples[-40:]).max() > 0.02 * peak * 0.5


def test_the_pair_it_writes_converts_and_opens_as_an_english_only_whisper(tokenizer, tmp_path):
    target_config, draft_config = ts.configs(tokenizer)
    assert target_config.decoder_layers == 6 and draft_config.decoder_layers == 1
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(draft_config)
    model.generation_config = ts.generation_config(tokenizer)
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(tmp_path / "hf")
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    rules = Whisper.of(Models(load_model(tmp_path / "mlx"), generation=read_generation_config(tmp_path / "mlx")))
    ids = tokenizer.token_to_id
    assert rules.languages == {} and rules.no_timestamps == ids("<|notimestamps|>")
    assert rules.end == ids("<|endoftext|>") and rules.start == ids("<|startoftranscript|>")
    assert rules.previous == ids("<|startofprev|>") and ids("<|0.00|>") == rules.no_timestamps + 1


def test_noisy_inputs_swap_about_the_rate_of_text_tokens_and_never_the_start_specials_or_timestamps(tokenizer):
    end = tokenizer.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    inputs = torch.randint(0, end + 1500, (64, 200))
    inputs[:, 0] = tokenizer.token_to_id("<|startoftranscript|>")
    noisy = ts.noisy(inputs, 0.25, end)
    text, swapped = inputs < end, noisy != inputs
    assert not swapped[:, 0].any() and not swapped[~text].any()
    assert (noisy[swapped] < end).all()
    assert 0.22 < swapped[text].float().mean() < 0.26  # (a random swap can draw the token it replaces)


def test_every_loss_is_finite_under_bf16_autocast_as_on_a_gpu(tokenizer):
    target_config, draft_config = ts.configs(tokenizer)
    torch.manual_seed(0)
    target, draft = WhisperForConditionalGeneration(target_config), WhisperForConditionalGeneration(draft_config)
    heard = torch.nn.Linear(target_config.d_model, len(ts.LETTERS) + 1)
    made = windows(tokenizer)
    features, labels = made.batch(2)
    parts = ts.step_losses(target, draft, heard, features, labels, made.spelled(labels), made.end, "cpu", autocast=True,
                           corrupt=0.25)
    assert set(parts) == {"target", "draft", "distilled", "ctc"}
    assert all(torch.isfinite(value) for value in parts.values())
