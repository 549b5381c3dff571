"""The shipped speech demo pair (demo/speech, made by demo/train_speech.py): an English-only Whisper of 10 s windows
whose draft decodes on the target's encoder output, held-out clips that are what clips.json says, drafted output that
is the target's own, and `main.py --demo --audio`, which shows a person what it heard and what drafting bought."""

import json
import wave
from pathlib import Path

import pytest

import main
import speech
import train_speech as ts
from loading import load

SPEECH = Path(__file__).resolve().parent.parent / "demo" / "speech"
CLIPS = json.loads((SPEECH / "clips" / "clips.json").read_text())


@pytest.fixture(scope="module")
def pair():
    return load(str(SPEECH / "target"), draft=str(SPEECH / "draft"))


def test_the_clips_are_held_out_sentences_spoken_as_16_khz_wav_files_under_1_mb_together():
    assert len(CLIPS) >= 3
    assert sum((SPEECH / "clips" / clip["file"]).stat().st_size for clip in CLIPS) < 1 << 20
    for clip in CLIPS:
        assert ts.held_out(clip["sentence"])  # never trained on
        with wave.open(str(SPEECH / "clips" / clip["file"])) as file:
            assert (file.getframerate(), file.getnchannels(), file.getsampwidth()) == (16_000, 1, 2)
            assert file.getnframes() / 16_000 == pytest.approx(clip["seconds"], abs=0.01)


def test_the_pairs_weights_fit_in_40_mb_as_the_t5_pairs_do():
    files = list(SPEECH.glob("*/model*.safetensors"))
    assert {f.parent.name for f in files} == {"target", "draft"}
    assert sum(f.stat().st_size for f in files) <= 40e6


def test_the_pair_is_an_english_only_whisper_of_10_s_windows_whose_draft_reads_the_targets_encoder_output(pair):
    record = json.loads((SPEECH / "training.json").read_text())
    assert speech.window_frames(pair.target) == record["window_seconds"] * 100 == 1000
    assert pair.draft.encoder is pair.target.encoder and pair.draft.stem is pair.target.stem
    assert pair.target.args.num_decoder_layers == 6 and pair.draft.args.num_decoder_layers == 1
    assert speech.Whisper.of(pair).languages == {}


@pytest.mark.parametrize("num_draft", [1, 3, 6])
def test_drafted_transcriptions_of_every_clip_are_the_targets_own(pair, num_draft):
    clips = [str(SPEECH / "clips" / clip["file"]) for clip in CLIPS]
    regular = speech.transcribe(pair, clips, speculative=False)
    drafted = speech.transcribe(pair, clips, speculative=True, num_draft=num_draft, delta=0.0)
    assert [t.tokens for t in drafted] == [t.tokens for t in regular]
    assert sum(t.stats.accepted for t in drafted) > 0


def test_the_target_hears_the_clips_as_well_as_training_measured(pair):
    """A pair that converted or loaded wrong, or a window decoded wrong, hears nothing: training measured a word error
    rate of 0.54 on 250 held-out clips, these 4 come to 0.77, and a model that hears nothing to 1 or more."""
    heard = speech.transcribe(pair, [str(SPEECH / "clips" / clip["file"]) for clip in CLIPS], speculative=False)
    assert ts.word_error_rate([clip["sentence"] for clip in CLIPS], [t.text for t in heard]) < 0.9


def test_the_command_line_demo_prints_the_sentence_what_it_heard_the_drafts_and_the_speedup(capsys):
    assert main.main(["--demo", "--audio"]) == 0
    out = capsys.readouterr().out
    assert "held-out-1.wav" in out and CLIPS[0]["sentence"] in out
    heard = out.split("Heard:\n", 1)[1].splitlines()
    assert heard[0].strip() and heard[1].startswith("Accepted ")
    assert "Speculative decoding decoded" in heard[2] and "as fast as regular decoding on this clip" in heard[2]


def test_the_command_line_demo_refuses_a_model_of_its_own_in_one_line(capsys):
    assert main.main(["--demo", "--audio", "--model", "openai/whisper-small"]) == 2
    assert "--demo --audio runs the pair in demo/speech" in capsys.readouterr().err
