"""Whisper: converted from transformers' checkpoints, fed log-mel features made as transformers makes them, from
audio files of any common format, and decoded token for token as transformers decodes, with and without a draft
that decodes on the target's encoder output."""

import io
import json
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support import chi_square_passes, decode_batch
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

import audio
import convert
import mlx.core as mx
from checkpoints import TOKENIZER_FILES
from loading import Models, load_model, load_tokenizer, read_generation_config
from options import Opening, Settings
from rows import Request

START, END = 0, 1  # the fixtures' decoder start and end of text (the tokenizer's pad and EOS)


def whisper_config(bins: int = 80, decoder_layers: int = 3, **overrides) -> WhisperConfig:
    # init_std 1: greedy output of many distinct tokens, each chosen by a margin (1.8e-3 of the logits' scale at
    # seed 1) far past float32 rounding.
    return WhisperConfig(**dict(vocab_size=1104, num_mel_bins=bins, encoder_layers=2, decoder_layers=decoder_layers,
                                d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
                                pad_token_id=0, bos_token_id=END, eos_token_id=END, decoder_start_token_id=START,
                                begin_suppress_tokens=None, init_std=1.0) | overrides)


def save(model: WhisperForConditionalGeneration, folder, tokenizer_dir) -> None:
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)


def spoken(text: str, tmp_path) -> np.ndarray:
    """espeak-ng's speech of text, 16 kHz samples (espeak-ng speaks at 22,050 Hz: PyAV resamples it)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng (a Debian package, which CI installs) speaks the test audio")
    path = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True)
    return audio.read(path)


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> np.ndarray:
    """(3000, 80) features of a rising tone in light noise: 5 s, padded to the 30 s window."""
    t = np.arange(audio.SAMPLE_RATE * 5) / audio.SAMPLE_RATE
    noise = np.random.default_rng(0).standard_normal(len(t))
    return audio.log_mel((0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.02 * noise).astype(np.float32), 80)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir, features):
    """A random Whisper target (3 decoder layers) converted, and a draft made
    as distil-whisper is: the target's encoder and its first and last decoder
    layers. The target's greedy output has many distinct tokens."""
    root = tmp_path_factory.mktemp("whisper")
    torch.manual_seed(1)
    target = WhisperForConditionalGeneration(whisper_config()).eval()
    save(target, root / "hf", tokenizer_dir)
    draft_config = whisper_config(decoder_layers=2)
    state = load_file(str(root / "hf" / "model.safetensors"))
    kept = {"model.decoder.layers.2.": "model.decoder.layers.1."}
    draft_state = {}
    for name, tensor in state.items():
        if name.startswith("model.decoder.layers.1."):
            continue
        for old, new in kept.items():
            name = name.replace(old, new)
        draft_state[name] = tensor
    (root / "hf_draft").mkdir()
    for file in (root / "hf").iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, root / "hf_draft" / file.name)
    draft_config.save_pretrained(root / "hf_draft")
    save_file(draft_state, str(root / "hf_draft" / "model.safetensors"), metadata={"format": "pt"})
    for name in ("hf", "hf_draft"):
        convert.convert(str(root / name), root / name.replace("hf", "mlx"), "float32", force=False)
    expected = reference_greedy(target, features, (START,), 40)
    assert len(expected) == 40 and len(set(expected)) >= 20
    return root, target, expected


@torch.no_grad()
def reference_greedy(model, features: np.ndarray, opening: tuple, max_tokens: int) -> list[int]:
    """Greedy ids from transformers' full forward passes (no cache), after the decoder's opening."""
    encoded = model.model.encoder(torch.tensor(features.T[None]))
    ids = list(opening)
    for _ in range(max_tokens):
        token = int(model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if token == END:
            break
        ids.append(token)
    return ids[len(opening):]


@pytest.mark.parametrize("bins", [80, 128])
def test_a_converted_whisper_computes_transformers_encoder_output_and_logits(tmp_path, tokenizer_dir, bins):
    """80 mel bins (tiny to large-v2) and 128 (large-v3 and turbo), float32."""
    torch.manual_seed(0)
    theirs = WhisperForConditionalGeneration(whisper_config(bins, init_std=0.02)).eval()
    save(theirs, tmp_path / "hf", tokenizer_dir)
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    ours = load_model(tmp_path / "mlx")
    features = np.random.default_rng(bins).standard_normal((1, 3000, bins)).astype(np.float32)
    tokens = [[START, 5, 17, 300, 42]]
    with torch.no_grad():
        encoded = theirs.model.encoder(torch.tensor(features.transpose(0, 2, 1))).last_hidden_state
        logits = theirs(encoder_outputs=(encoded,), decoder_input_ids=torch.tensor(tokens)).logits
    our_encoded = ours.encode(mx.array(features))
    np.testing.assert_allclose(np.array(our_encoded), encoded.numpy(), atol=2e-5 * float(encoded.abs().max()))
    our_logits = ours.decode(mx.array(tokens), ours.make_cache(our_encoded))
    np.testing.assert_allclose(np.array(our_logits), logits.numpy(), atol=2e-5 * float(logits.abs().max()))


@pytest.mark.parametrize("bins", [80, 128])
def test_log_mel_features_equal_transformers_feature_extractor_within_1e_4(tmp_path, bins):
    """espeak-ng's speech, padded to 30 s as transformers pads a short file,
    and 3 copies of it (over 30 s) at their own length as long-form reads them."""
    speech = spoken("The quick brown fox jumps over the lazy dog, twice.", tmp_path)
    extractor = WhisperFeatureExtractor(feature_size=bins)
    theirs = extractor(speech, sampling_rate=audio.SAMPLE_RATE, return_tensors="np").input_features[0].T
    assert theirs.shape == (audio.WINDOW_FRAMES, bins)
    np.testing.assert_allclose(audio.log_mel(speech, bins), theirs, atol=1e-4)
    long = np.tile(speech, 3 * audio.WINDOW_SECONDS // max(1, len(speech) // audio.SAMPLE_RATE))
    long = np.concatenate([long, speech[: 160 * (len(long) // 160 + 1) - len(long) + 77]])  # 77 past a frame
    theirs = extractor(long, sampling_rate=audio.SAMPLE_RATE, return_tensors="np", truncation=False,
                       padding="longest").input_features[0].T
    assert theirs.shape[0] > audio.WINDOW_FRAMES
    np.testing.assert_allclose(audio.log_mel(long, bins, frames=theirs.shape[0]), theirs, atol=1e-4)


def encoded_as(samples: np.ndarray, rate: int, channels: int, codec: str, container: str) -> bytes:
    """samples (mono, float32) in a file of another format, written by PyAV."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as file:
        stream = file.add_stream(codec, rate=rate, layout="stereo" if channels == 2 else "mono")
        # planar float samples, a row a channel: the stream converts them to its codec's format
        frame = av.AudioFrame.from_ndarray(np.tile(samples, (channels, 1)), format="fltp",
                                           layout="stereo" if channels == 2 else "mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            file.mux(packet)
        for packet in stream.encode(None):
            file.mux(packet)
    return out.getvalue()


@pytest.mark.parametrize("codec,container", [("flac", "flac"), ("libmp3lame", "mp3"), ("libopus", "ogg"),
                                             ("aac", "ipod"), ("libopus", "webm"), ("pcm_f32le", "wav")])
def test_audio_of_each_common_format_reads_as_the_same_16khz_mono_samples(tmp_path, codec, container):
    """A 440 Hz tone at 44.1 kHz in stereo, written in each format: read back
    at 16 kHz, mono, the tone's length within 60 ms (codecs pad) and its
    frequency kept (the spectrum's peak)."""
    import av

    rate = 48_000 if codec == "libopus" else 44_100
    t = np.arange(rate * 2) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    try:
        data = encoded_as(tone, rate, 2, codec, container)
    except (av.error.FFmpegError, ValueError) as e:  # an encoder this PyAV build lacks
        pytest.skip(f"PyAV cannot write {codec}: {e}")
    samples = audio.read(data)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 2 * audio.SAMPLE_RATE) < 0.06 * audio.SAMPLE_RATE
    spectrum = np.abs(np.fft.rfft(samples[: audio.SAMPLE_RATE]))
    assert abs(np.argmax(spectrum) - 440) <= 2  # one bin a hertz


def test_a_truncated_wav_reads_as_the_whole_samples_it_holds():
    assert audio.read(wav_header(100) + b"\x01\x02\x03").tolist() == [0x0201 / 32768]


def test_a_16khz_pcm_wav_is_read_by_the_standard_library_as_pyav_reads_it(tmp_path):
    import wave

    samples = (np.sin(np.arange(16_000) / 10) * 20_000).astype(np.int16)
    path = tmp_path / "plain.wav"
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1), file.setsampwidth(2), file.setframerate(16_000)
        file.writeframes(samples.tobytes())
    np.testing.assert_array_equal(audio.read(path), samples / np.float32(32768))
    np.testing.assert_allclose(audio._decoded(path.read_bytes()), samples / np.float32(32768), atol=1e-6)


def wav_header(frames: int) -> bytes:
    """A 16 kHz 16-bit mono WAV's header announcing `frames` samples."""
    import struct

    size = frames * 2
    return (b"RIFF" + struct.pack("<I", 36 + size) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, 16_000, 32_000, 2, 16)
            + b"data" + struct.pack("<I", size))


@pytest.mark.parametrize("data,message", [(b"", "the audio file is empty"),
                                          (wav_header(100), "holds no samples"),

                                          (b"hello, this is text" * 20, "not an audio file this can read"),
                                          (b"RIFF\x00\x00\x00\x00WAVEjunk", "not an audio file this can read")])
def test_what_is_not_audio_is_a_one_line_error(data, message):
    with pytest.raises(audio.AudioError, match=message) as error:
        audio.read(data)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("drafted", [False, True])
def test_greedy_whisper_decodes_as_transformers_with_and_without_a_draft(pair, features, drafted):
    """Features as the request's source, the decoder's opening given: the
    target's greedy tokens, regular and drafted (the draft the target's
    encoder and two of its decoder layers), alone and beside another row."""
    root, _, expected = pair
    models = Models(load_model(root / "mlx"), load_model(root / "mlx_draft") if drafted else None)
    settings = Settings(max_tokens=40, speculative=drafted, num_draft=3, delta=0.0)
    other = np.roll(features, 500, axis=0)
    requests = [Request(mx.array(source), settings, opening=Opening((START,))) for source in (features, other)]
    tokens, _ = decode_batch(models, requests, 2)
    assert tokens[0] == expected
    alone, _ = decode_batch(models, requests[1:], 1)
    assert tokens[1] == alone[0] != expected


# ---------------------------------------------------------------- Whisper's conventions: speech.py

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
            "<|nospeech|>", "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
SUPPRESSED, FIRST_SUPPRESSED = [5, 6, 7, 2244], [220, 2537]  # the fixture's greedy first token, and a later one
END_OF_TEXT = 1100  # the spoken fixture's (its tokenizer's 1,100 tokens, then SPECIALS)


@pytest.fixture(scope="module")
def spoken_pair(tmp_path_factory, tokenizer_dir):
    """A multilingual Whisper laid out as the real ones are (text tokens,
    then the end of text, the start of transcript, languages, tasks,
    no-speech, no-timestamps and 1,501 timestamps), with a generation config
    as Hugging Face publishes one, converted; and a distil-style draft. A
    5 s file of a rising tone. init_std 0.2 at seed 1: 40 greedy tokens, 12
    of them distinct, each chosen by a margin of 1e-3 or more (the logits'
    scale is 7; ours differ from transformers' by 1e-5 at most)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import GenerationConfig

    root = tmp_path_factory.mktemp("spoken")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    ids = {token: first + i for i, token in enumerate(SPECIALS[:8])}
    end, start = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = whisper_config(vocab_size=first + len(SPECIALS), pad_token_id=end, bos_token_id=end, eos_token_id=end,
                            decoder_start_token_id=start, init_std=0.2)
    torch.manual_seed(1)
    target = WhisperForConditionalGeneration(config).eval()
    target.generation_config = GenerationConfig(
        decoder_start_token_id=start, eos_token_id=end, pad_token_id=end, bos_token_id=end,
        lang_to_id={"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], is_multilingual=True, suppress_tokens=SUPPRESSED,
        begin_suppress_tokens=FIRST_SUPPRESSED, max_initial_timestamp_index=50, max_length=448)
    target.save_pretrained(root / "hf")
    tokenizer.save(str(root / "hf" / "tokenizer.json"))
    convert.convert(str(root / "hf"), root / "mlx", "float32", force=False)
    t = np.arange(audio.SAMPLE_RATE * 5) / audio.SAMPLE_RATE
    tone = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.02 * np.random.default_rng(0).standard_normal(len(t))
    path = root / "tone.wav"
    import wave

    with wave.open(str(path), "wb") as file:
        file.setnchannels(1), file.setsampwidth(2), file.setframerate(audio.SAMPLE_RATE)
        file.writeframes((tone * 32767).astype(np.int16).tobytes())
    return root, target, ids, path


@torch.no_grad()
def reference_transcription(model, features: np.ndarray, opening: list[int], max_tokens: int,
                            timestamps: bool = False) -> list[int]:
    """Greedy ids from transformers' forward passes with its own Whisper
    logits processors, in the order its generate applies them: those
    suppressed at the start, the config's suppressed tokens, and the
    timestamps' (when asked for)."""
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                         SuppressTokensLogitsProcessor,
                                                         WhisperTimeStampLogitsProcessor)

    generation = model.generation_config
    processors = [SuppressTokensAtBeginLogitsProcessor(generation.begin_suppress_tokens, len(opening)),
                  SuppressTokensLogitsProcessor(generation.suppress_tokens)]
    if timestamps:
        processors.append(WhisperTimeStampLogitsProcessor(generation, begin_index=len(opening)))
    encoded = model.model.encoder(torch.tensor(features.T[None]))
    ids = list(opening)
    for _ in range(max_tokens):
        logits = model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([ids])).logits[:, -1]
        for processor in processors:
            if isinstance(processor, WhisperTimeStampLogitsProcessor):  # its check's margin, past rounding
                check = WhisperTimeStampLogitsProcessor(generation, len(opening), _detect_timestamp_from_logprob=False)
                logprobs = torch.log_softmax(check(torch.tensor([ids]), logits.clone()), dim=-1)[0]
                first = generation.no_timestamps_token_id + 1
                assert abs(logprobs[first:].logsumexp(-1) - logprobs[:first].max()) > 1e-4 or ids == list(opening)
            logits = processor(torch.tensor([ids]), logits)
        top = torch.topk(logits[0], 2).values
        assert top[0] - top[1] > 1e-3  # a margin rounding cannot cross
        token = int(logits[0].argmax())
        if token == generation.eos_token_id:
            break
        ids.append(token)
    return ids[len(opening):]


class Margins:
    """A logits processor that runs last in transformers' generate and asserts each greedy choice wins by a
    margin rounding cannot cross."""

    def __call__(self, input_ids, scores):
        top = torch.topk(scores, 2, dim=-1).values
        assert ((top[:, 0] - top[:, 1] > 1e-3) | ~torch.isfinite(top[:, 1])).all()
        return scores


@torch.no_grad()
def generated(model, features: np.ndarray, **options) -> list[tuple[float, float, list[int]]]:
    """transformers' Whisper generate on one file's features (its whole length, as long-form reads it): each
    segment's (start, end, tokens), greedy choices checked for their margins."""
    out = model.generate(torch.tensor(features.T[None]), attention_mask=torch.ones(1, len(features), dtype=torch.long),
                         return_segments=True, logits_processor=[Margins()], **options)
    return [(round(float(segment["start"]), 2), round(float(segment["end"]), 2), segment["tokens"].tolist())
            for segment in out["segments"][0]]


def ours(transcription) -> list[tuple[float, float, list[int]]]:
    return [(segment["start"], segment["end"], segment["tokens"]) for segment in transcription.segments]


@pytest.mark.parametrize("drafted", [False, True])
def test_a_file_transcribes_as_transformers_decodes_it_with_whispers_opening_and_suppressions(spoken_pair, drafted):
    """Language and task given: the opening is the start of transcript,
    <|en|>, <|transcribe|>, <|notimestamps|>; the config's suppressed tokens
    never come, those suppressed at the start not first (each would have:
    the test fails without either rule), regular and drafted by a model
    that knows no rule but the fixed ones."""
    import speech

    root, target, ids, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    opening = [ids[token] for token in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")]
    expected = reference_transcription(target, features, opening, 40)
    assert len(expected) == 40 and len(set(expected)) >= 10
    theirs = generated(target, features, language="en", task="transcribe", max_new_tokens=40)
    assert [token for _, _, tokens in theirs for token in tokens][:20] == expected[:20]
    models = Models(load_model(root / "mlx"), load_model(root / "mlx") if drafted else None,
                    tokenizer=load_tokenizer(root / "mlx"), generation=read_generation_config(root / "mlx"))
    (transcription,) = speech.transcribe(models, [path], language="en", max_tokens=40, speculative=drafted,
                                         num_draft=3, delta=0.0)
    assert ours(transcription) == theirs and transcription.language == "en"
    assert transcription.duration == pytest.approx(5.0)
    text = [token for token in transcription.tokens if token < END_OF_TEXT]
    assert transcription.text == models.tokenizer.decode(text, skip_special_tokens=True).strip()
    plain = reference_greedy(target, features, tuple(opening), 40)
    assert plain[0] in FIRST_SUPPRESSED and set(plain) & set(SUPPRESSED)  # what the rules kept out


def test_without_a_language_the_spoken_one_is_detected_as_transformers_detects_it(spoken_pair):
    import speech

    root, target, ids, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    detected = int(target.detect_language(torch.tensor(features.T[None]))[0])
    models = Models(load_model(root / "mlx"), tokenizer=load_tokenizer(root / "mlx"),
                    generation=read_generation_config(root / "mlx"))
    (transcription,) = speech.transcribe(models, [path, path], max_tokens=20)[:1]
    code = next(code for code, token in ids.items() if token == detected).strip("<|>")
    assert transcription.language == code
    assert ours(transcription) == generated(target, features, task="transcribe", max_new_tokens=20)


def test_what_whisper_cannot_do_is_refused_in_one_line(spoken_pair, v1_1_checkpoint):
    import speech
    from errors import OptionError

    root, _, _, path = spoken_pair
    models = Models(load_model(root / "mlx"), tokenizer=load_tokenizer(root / "mlx"),
                    generation=read_generation_config(root / "mlx"))
    with pytest.raises(OptionError, match=r"unknown language 'de' \(this model's: en, fr\)"):
        speech.transcribe(models, [path], language="de")
    with pytest.raises(OptionError, match="task must be transcribe or translate"):
        speech.transcribe(models, [path], task="summarize")
    with pytest.raises(OptionError, match="max_tokens is 445: with the 4 tokens the decoder opens with, this model's "
                                          "448 positions leave 444 for the output"):
        speech.transcribe(models, [path], language="en", max_tokens=445)
    with pytest.raises(OptionError, match="reads text, not audio"):
        speech.transcribe(Models(load_model(v1_1_checkpoint.mlx_dir)), [path])


def test_each_command_names_what_a_models_kind_takes(spoken_pair, v1_1_checkpoint, tmp_path, capsys):
    """convert.py's closing line names the command that runs what it converted; a prompt for a Whisper, or audio for
    a text model, is a one-line error that says what to run (not a traceback, nor a t5-small draft asked for)."""
    import main

    root, _, _, path = spoken_pair
    whisper, text_model = str(root / "mlx"), str(v1_1_checkpoint.mlx_dir)
    for source, out, command in ((root / "hf", tmp_path / "speech", "--audio FILE"),
                                 (v1_1_checkpoint.hf_dir, tmp_path / "text", "--regular-decode")):
        assert convert.main(["--model", str(source), "--out", str(out), "--dtype", "float32"]) == 0
        assert f"Try it: python main.py --model {out} {command}" in capsys.readouterr().out
    for argv in (["--model", whisper, "--prompt", "Good morning.", "--regular-decode"], ["--model", whisper]):
        assert main.main(argv) == 2
        error = capsys.readouterr().err
        assert error == f"error: {whisper} is a speech model (Whisper): it transcribes audio, not a prompt: " \
                        f"python main.py --model {whisper} --audio FILE\n"
    assert main.main(["--model", text_model, "--audio", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {text_model} is a text model: --audio needs a converted Whisper") and error.count("\n") == 1


def test_the_command_line_transcribes_files_and_prints_openais_verbose_json(spoken_pair, tmp_path, capsys):
    import json

    import main

    root, target, ids, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    theirs = generated(target, features, language="fr", task="transcribe", max_new_tokens=12)
    assert main.main(["--model", str(root / "mlx"), "--audio", str(path), str(path), "--language", "fr",
                      "--max-tokens", "12", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    figures = ("avg_logprob", "compression_ratio", "no_speech_prob")  # the same file's, to rounding (its batch row)
    for first, second in zip(records[0]["segments"], records[1]["segments"]):
        assert {key: value for key, value in first.items() if key not in figures} == \
            {key: value for key, value in second.items() if key not in figures}
        assert [first[key] for key in figures] == pytest.approx([second[key] for key in figures], rel=1e-5)
    assert len(records) == 2 and records[0]["language"] == "french" and records[0]["duration"] == 5.0
    assert len(records[0]["segments"]) == len(records[1]["segments"]) == len(theirs)
    assert [(segment["start"], segment["end"], segment["tokens"]) for segment in records[0]["segments"]] == theirs
    assert set(records[0]["segments"][0]) == {"id", "seek", "start", "end", "text", "tokens", "temperature", *figures}
    (tmp_path / "notes.txt").write_text("not audio at all, just some words " * 10)
    assert main.main(["--model", str(root / "mlx"), "--audio", str(tmp_path / "notes.txt")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "notes.txt: not an audio file this can read" in error
    assert error.count("\n") == 1
    assert main.main(["--audio", str(path)]) == 2
    assert "--audio needs --model" in capsys.readouterr().err
    for mode in ("--compare", "--interactive", "--sweep"):  # text modes: refused, not silently ignored
        assert main.main(["--model", str(root / "mlx"), "--audio", str(path), mode]) == 2
        assert "take text prompts, not --audio" in capsys.readouterr().err


def test_a_draft_that_keeps_its_targets_encoder_decodes_on_the_targets_encoder_output(pair, features, monkeypatch):
    """distil-whisper's kind of draft: found by its weights at load, its
    encoder is the target's (one copy), run once for both; the tokens are the
    target's. A draft whose encoder differs in one weight keeps its own."""
    from loading import load
    from model import Encoder

    root, _, expected = pair
    models = load(root / "mlx", draft=root / "mlx_draft")
    assert models.draft.encoder is models.target.encoder and models.draft.stem is models.target.stem
    runs, real = [], Encoder.pieces

    def counted(self, *args):
        runs.append(self)
        return (yield from real(self, *args))

    monkeypatch.setattr(Encoder, "pieces", counted)
    settings = Settings(max_tokens=40, num_draft=3, delta=0.0)
    tokens, _ = decode_batch(models, [Request(mx.array(features), settings, opening=Opening((START,)))], 1)
    assert tokens[0] == expected and len(runs) == 1
    changed = root / "mlx_draft_changed"
    shutil.copytree(root / "mlx_draft", changed)
    weights = mx.load(str(changed / "model.safetensors"))
    weights["encoder.layers.0.ffn.wo.bias"] = weights["encoder.layers.0.ffn.wo.bias"] + 1e-3
    mx.save_safetensors(str(changed / "model.safetensors"), weights, metadata={"format": "mlx"})
    models = load(root / "mlx", draft=changed)
    assert models.draft.encoder is not models.target.encoder
    runs.clear()
    tokens, _ = decode_batch(models, [Request(mx.array(features), settings, opening=Opening((START,)))], 1)
    assert tokens[0] == expected and len(runs) == 2


@pytest.mark.parametrize("drafted", [False, True])
def test_timestamps_follow_transformers_rules_and_mark_the_segments(spoken_pair, drafted):
    """With timestamps: no <|notimestamps|> in the opening; transformers'
    timestamp rules (pairs, never earlier than the last, the first no later
    than 1 s, a timestamp whenever the timestamps' probability together beats
    the likeliest text token's), then the suppressions, in its order; the
    segments run between them."""
    import speech

    root, target, ids, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    opening = [ids[token] for token in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>")]
    expected = reference_transcription(target, features, opening, 40, timestamps=True)
    first = ids["<|notimestamps|>"] + 1
    stamps = [token for token in expected if token >= first]
    assert len(stamps) >= 4 and len(expected) - len(stamps) >= 4  # both kinds, decided by the rules
    models = Models(load_model(root / "mlx"), load_model(root / "mlx") if drafted else None,
                    tokenizer=load_tokenizer(root / "mlx"), generation=read_generation_config(root / "mlx"))
    (transcription,) = speech.transcribe(models, [path], language="en", timestamps=True, max_tokens=40,
                                         speculative=drafted, num_draft=3, delta=0.0)
    # The first window's segments, up to its last pair of timestamps, are the reference's tokens; the next window
    # starts there, as transformers' generate decodes it.
    theirs = generated(target, features, language="en", task="transcribe", return_timestamps=True, max_new_tokens=40)
    assert ours(transcription) == theirs
    kept = [token for segment in transcription.segments if segment["seek"] == 0 for token in segment["tokens"]]
    assert len(kept) >= 8 and kept == expected[: len(kept)]  # the first window's, to its last pair
    assert len({segment["seek"] for segment in transcription.segments}) > 1
    segments = transcription.segments
    assert segments and all(segment["tokens"][0] >= first for segment in segments)


def test_by_default_the_output_takes_the_positions_the_opening_leaves(spoken_pair, monkeypatch):
    """As transformers' max_length of 448 does: a window's 444 tokens after an opening of 4, 445 after 3
    (timestamps)."""
    import speech

    root, _, _, path = spoken_pair
    models = Models(load_model(root / "mlx"), tokenizer=load_tokenizer(root / "mlx"),
                    generation=read_generation_config(root / "mlx"))
    windows, real = [], speech.Listening.ended

    def ended(self, track, finish, cross=None):
        windows.append((len(track.window.tokens), finish))
        return real(self, track, finish, cross)

    monkeypatch.setattr(speech.Listening, "ended", ended)
    for timestamps, most in ((False, 444), (True, 445)):
        windows.clear()
        speech.transcribe(models, [path], language="en", timestamps=timestamps)
        assert windows[0] == (most, "length")  # no end of text comes


def test_a_transcription_renders_in_each_of_openais_response_formats():
    import json
    from dataclasses import replace

    import speech
    from options import Stats

    segments = [{"start": 0.0, "end": 2.5, "text": " Hello there.", "tokens": [3, 4]},
                {"start": 2.5, "end": 2.5, "text": " ", "tokens": [6]},  # no text: no subtitle
                {"start": 2.5, "end": 3725.5, "text": " A long one.", "tokens": [5]}]
    heard = speech.Transcription("Hello there. A long one.", [3, 4, 5], "en", 3726.0, "stop", Stats(), segments)
    assert speech.render(heard, "text") == "Hello there. A long one.\n"
    assert json.loads(speech.render(heard, "json")) == {"text": "Hello there. A long one."}
    verbose = json.loads(speech.render(heard, "verbose_json"))
    assert verbose["language"] == "english" and verbose["duration"] == 3726.0 and verbose["segments"][1]["id"] == 1
    for code, name in [("zh", "chinese"), ("es", "spanish"), ("my", "myanmar"), ("nl", "dutch")]:  # names, not aliases
        assert json.loads(speech.render(replace(heard, language=code), "verbose_json"))["language"] == name
    assert speech.render(heard, "srt") == ("1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
                                           "2\n00:00:02,500 --> 01:02:05,500\nA long one.\n")
    assert speech.render(heard, "vtt") == ("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
                                           "00:00:02.500 --> 01:02:05.500\nA long one.\n")


def test_the_command_line_writes_subtitles_beside_each_other_in_a_folder(spoken_pair, tmp_path, capsys):
    """--output-format srt turns timestamps on; --output-dir names each file after its audio."""
    import main
    import speech

    root, target, ids, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    theirs = generated(target, features, language="en", task="transcribe", return_timestamps=True, max_new_tokens=30)
    assert main.main(["--model", str(root / "mlx"), "--audio", str(path), "--language", "en", "--max-tokens", "30",
                      "--output-format", "srt", "--output-dir", str(tmp_path)]) == 0
    written = (tmp_path / "tone.srt").read_text()
    (timed,) = speech.transcribe(spoken_models(root), [path], language="en", timestamps=True, max_tokens=30)
    assert ours(timed) == theirs and written == speech.render(timed, "srt")
    assert written.startswith("1\n00:00:") and written.count(" --> ") >= 2
    assert f"{path} -> {tmp_path / 'tone.srt'}" in capsys.readouterr().out
    (tmp_path / "again").mkdir()
    shutil.copy(path, tmp_path / "again" / "tone.wav")
    assert main.main(["--model", str(root / "mlx"), "--audio", str(path), str(tmp_path / "again" / "tone.wav"),
                      "--output-dir", str(tmp_path)]) == 2
    assert "two files named tone would write one output" in capsys.readouterr().err


def test_a_whisper_quantizes_its_projections_and_keeps_its_convolutions_and_tables(spoken_pair, tmp_path):
    """8-bit: the projections and the embedding quantized, the stem's convolutions and the position tables not; the
    quantized model's logits within 8-bit rounding of the float model's."""
    from convert import Quantization

    root, _, _, _ = spoken_pair
    convert.convert(str(root / "hf"), tmp_path / "q8", "float32", force=False, quantization=Quantization(8, 64))
    weights = mx.load(str(tmp_path / "q8" / "model.safetensors"))
    assert "encoder.layers.0.attention.q.scales" in weights and "shared.scales" in weights
    assert not any(name.startswith(("stem.", "encoder.positions", "decoder.positions")) and name.endswith(".scales")
                   for name in weights)
    features = mx.array(np.random.default_rng(0).standard_normal((1, 3000, 80)).astype(np.float32))
    tokens = mx.array([[1101, 1102, 1105, 1107, 5, 17]])
    logits = [np.array(model.decode(tokens, model.make_cache(model.encode(features))))
              for model in (load_model(root / "mlx"), load_model(tmp_path / "q8"))]
    assert np.abs(logits[0] - logits[1]).max() < 0.05 * np.abs(logits[0]).max()


@pytest.fixture(scope="module")
def ctranslate2_folders(spoken_pair, tmp_path_factory):
    """The spoken fixture converted by CTranslate2's own converter, as faster-whisper's models are made: name ->
    folder, for float32 and each of the types faster-whisper's models ship in."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    root, folders = spoken_pair[0], {}
    for quantization in ("float32", "float16", "bfloat16", "int8_float32"):
        folders[quantization] = tmp_path_factory.mktemp("ct2") / quantization
        ctranslate2.converters.TransformersConverter(str(root / "hf"), copy_files=["tokenizer.json"]).convert(
            str(folders[quantization]), quantization=quantization)
    return folders


# Half a unit in the last place of float16 and bfloat16 (relative; float16's subnormals below 6e-5 are spaced
# 2^-24 apart), half an int8 step of a row's largest value.
ROUNDING = {"float32": (0.0, 0.0), "float16": (2.0 ** -11, 2.0 ** -25), "bfloat16": (2.0 ** -8, 0.0)}


def test_a_ctranslate2_whisper_converts_to_the_weights_and_configs_of_its_hugging_face_checkpoint(
        spoken_pair, ctranslate2_folders, tmp_path):
    """faster-whisper's layout (CTranslate2's model.bin, its config.json, the tokenizer): every weight of the
    conversion is that of the Hugging Face checkpoint's (float32: exactly, the fused projections split in the right
    order; float16 and bfloat16 within half a unit in their last place; int8 within half a step of its row's
    scale), and the generation config carries the checkpoint's ids, languages, tasks and suppressions."""
    root = spoken_pair[0]
    ours = mx.load(str(root / "mlx" / "model.safetensors"))
    for quantization, folder in ctranslate2_folders.items():
        convert.convert(str(folder), tmp_path / quantization, "float32", force=False)
        theirs = mx.load(str(tmp_path / quantization / "model.safetensors"))
        assert set(theirs) == set(ours), quantization
        for name, want in ours.items():
            got, want = np.array(theirs[name]), np.array(want)
            if quantization.startswith("int8") and want.ndim >= 2 and not name.endswith("positions.weight"):
                step = np.abs(want.reshape(len(want), -1)).max(axis=1) / 127
                bound = (step / 2 * 1.0001).reshape([-1] + [1] * (want.ndim - 1)) + 1e-7
            else:
                relative, subnormal = ROUNDING.get(quantization, (0.0, 0.0))
                bound = relative * np.abs(want) * 1.0001 + subnormal
            assert (np.abs(got - want) <= bound).all(), (quantization, name)
    import from_ctranslate2  # and written back as a Hugging Face checkpoint (bench whisper's references read it)

    from_ctranslate2.write_checkpoint(ctranslate2_folders["float32"], tmp_path / "hf")
    written, original = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(root / "hf" / "model.safetensors"))
    assert set(written) == {name for name in original if not name.endswith("k_proj.bias") and name != "proj_out.weight"}
    assert all(torch.equal(written[name], original[name]) for name in written)
    generation = read_generation_config(tmp_path / "float16")
    published = json.loads((root / "hf" / "generation_config.json").read_text())
    for key in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id", "is_multilingual",
                "lang_to_id", "task_to_id", "suppress_tokens", "begin_suppress_tokens", "max_initial_timestamp_index"):
        assert generation[key] == published[key], key
    config, expected = read_config_json(tmp_path / "float16"), read_config_json(root / "mlx")
    assert {k: config[k] for k in ("vocab_size", "d_model", "num_layers", "num_decoder_layers", "num_heads", "d_ff",
                                   "num_mel_bins", "max_positions", "encoder_positions")} == \
        {k: expected[k] for k in ("vocab_size", "d_model", "num_layers", "num_decoder_layers", "num_heads", "d_ff",
                                  "num_mel_bins", "max_positions", "encoder_positions")}


def read_config_json(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_what_is_not_a_ctranslate2_whisper_with_its_tokenizer_is_a_one_line_error_and_no_folder(
        ctranslate2_folders, v1_1_checkpoint, tmp_path, capsys):
    """A CTranslate2 model of another architecture (T5), a model.bin cut short, a folder without its tokenizer:
    convert.py's one-line error, and no output folder."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    t5 = tmp_path / "t5"
    ctranslate2.converters.TransformersConverter(str(v1_1_checkpoint.hf_dir)).convert(str(t5))
    cut = tmp_path / "cut"
    shutil.copytree(ctranslate2_folders["float16"], cut)
    data = (cut / "model.bin").read_bytes()
    (cut / "model.bin").write_bytes(data[:len(data) // 2])
    untokenized = tmp_path / "untokenized"
    shutil.copytree(ctranslate2_folders["float16"], untokenized)
    (untokenized / "tokenizer.json").unlink()
    capsys.readouterr()  # (transformers' loading bars)
    for folder, message in ((t5, "is a CTranslate2 TransformerSpec: convert.py takes CTranslate2's Whisper"),
                            (cut, "is truncated or not CTranslate2's model.bin"),
                            (untokenized, "has no readable tokenizer.json")):
        assert convert.main(["--model", str(folder), "--out", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1, error
        assert not (tmp_path / "out").exists()


def test_the_timestamps_check_comes_after_the_suppressions_as_transformers_orders_them():
    """A suppressed token with the text's largest logit: transformers bans it
    first, then finds the timestamps' probability together above the next
    text token's and forces a timestamp. The batch's logits are
    transformers' processed ones, -inf where they are."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                         SuppressTokensLogitsProcessor,
                                                         WhisperTimeStampLogitsProcessor)

    import speech
    from sampling import Penalties, RowPenalties

    end, start, no_timestamps, vocabulary = 10, 9, 11, 20  # timestamps: 12 to 19
    generation = GenerationConfig(eos_token_id=end, no_timestamps_token_id=no_timestamps, suppress_tokens=[3],
                                  begin_suppress_tokens=[4], max_initial_timestamp_index=5)
    whisper = speech.Whisper(start, end, no_timestamps=no_timestamps, suppress=(3,), begin_suppress=(4,),
                             vocabulary=vocabulary, max_initial=5)
    opening = Opening((start,))
    logits = np.full(vocabulary, -10.0, np.float32)
    logits[3], logits[4], logits[12:16] = 5.0, 2.0, 1.5  # suppressed 5; text 2; four timestamps, together 2.9
    for before in ([12, 5], [12, 5, 6]):  # a timestamp, then text
        ids = torch.tensor([[start, *before]])
        theirs = torch.tensor(logits)[None]
        for processor in (SuppressTokensAtBeginLogitsProcessor(generation.begin_suppress_tokens, 1),
                          SuppressTokensLogitsProcessor(generation.suppress_tokens),
                          WhisperTimeStampLogitsProcessor(generation, begin_index=1)):
            theirs = processor(ids, theirs)
        penalties = RowPenalties([Penalties(rules=whisper.rules(opening, timestamps=True))], [opening.start], end,
                                 vocabulary)
        ours = penalties.apply(mx.array(logits)[None, None], mx.zeros((1, 1, vocabulary)), mx.array([[len(before)]]),
                               mx.array([[start, *before]]))
        np.testing.assert_allclose(np.array(ours)[0, 0], theirs[0].numpy())
        assert int(theirs[0].argmax()) >= 12  # a timestamp forced: the check saw the suppressed token gone


def test_a_files_segments_stream_as_their_closing_timestamps_are_decided(spoken_pair, monkeypatch):
    """stream_transcribe yields transcribe's segments, each as soon as the
    timestamps after it show it final: the first long before decoding ends
    (the window's figures, known at its end, left out until then)."""
    import decoder
    import speech

    root, _, _, path = spoken_pair
    models = Models(load_model(root / "mlx"), tokenizer=load_tokenizer(root / "mlx"),
                    generation=read_generation_config(root / "mlx"))
    (whole,) = speech.transcribe(models, [path], language="en", timestamps=True, max_tokens=40)
    events, real = [], decoder.RegularBatch.round

    def counted(self):
        for event in real(self):
            events.append(event)
            yield event

    monkeypatch.setattr(decoder.RegularBatch, "round", counted)
    streamed, decided = [], []
    for segment in speech.stream_transcribe(models, path, language="en", max_tokens=40):
        streamed.append(segment)
        decided.append(len(events))
    figures = ("avg_logprob", "compression_ratio")
    assert [{key: value for key, value in segment.items() if key not in figures} for segment in streamed] == \
        [{key: value for key, value in segment.items() if key not in figures} for segment in whole.segments]
    assert len(streamed) >= 2 and streamed[0]["avg_logprob"] is None and streamed[-1]["avg_logprob"] is not None
    assert decided[0] < len(events) // 4


# ---------------------------------------------------------------- long files: the sequential algorithm

@pytest.fixture(scope="module")
def long_file(spoken_pair):
    """75 s and 77 samples: the tone at three loudnesses, between stretches of quiet noise, as a 16 kHz WAV (noise seed 9: every
    greedy choice of the tests below wins by a margin of 1e-3; at seeds 2 and 3 one does not)."""
    import wave

    root, _, _, path = spoken_pair
    tone, quiet = audio.read(path), 0.01 * np.random.default_rng(9).standard_normal(5 * audio.SAMPLE_RATE)
    samples = np.concatenate([tone * (1 + i % 3) if i % 4 else quiet for i in range(15)] + [quiet[:77]])
    long = root / "long.wav"  # (77 samples past a whole frame: the last frame reads them, as transformers' does)
    with wave.open(str(long), "wb") as file:
        file.setnchannels(1), file.setsampwidth(2), file.setframerate(audio.SAMPLE_RATE)
        file.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())
    return long


def spoken_models(root, drafted: bool = False) -> Models:
    return Models(load_model(root / "mlx"), load_model(root / "mlx") if drafted else None,
                  tokenizer=load_tokenizer(root / "mlx"), generation=read_generation_config(root / "mlx"))


def whole_features(path) -> np.ndarray:
    samples = audio.read(path)
    return audio.log_mel(samples, 80, frames=len(samples) // audio.HOP)


@pytest.mark.parametrize("drafted", [False, True])
def test_a_long_file_decodes_window_by_window_as_transformers_long_form_generate(spoken_pair, long_file, drafted):
    """Over 30 s: each window starts at the last one's last pair of
    timestamps (the whole window when it ends on a lone one), the last padded
    with zeros, max_tokens counting a window's tokens: segment for segment
    (start, end, tokens) as transformers' long-form generate, regular and
    drafted."""
    import speech

    root, target, _, _ = spoken_pair
    features = whole_features(long_file)
    theirs = generated(target, features, language="en", task="transcribe", return_timestamps=True, max_new_tokens=60)
    (transcription,) = speech.transcribe(spoken_models(root, drafted), [long_file], language="en", max_tokens=60,
                                         speculative=drafted, num_draft=3, delta=0.0)
    assert ours(transcription) == theirs
    seeks = [segment["seek"] for segment in transcription.segments]
    assert len(set(seeks)) >= 3 and max(seeks) > len(features) - audio.WINDOW_FRAMES  # the last window is padded
    assert transcription.duration == pytest.approx(75.0048125)
    assert transcription.tokens == [token for _, _, tokens in theirs for token in tokens]


def test_a_whisper_of_a_shorter_window_is_decoded_a_window_of_its_own_at_a_time_as_transformers_does(
        spoken_pair, long_file, tmp_path):
    """A Whisper made with max_source_positions 500 (a 10 s window): a 5 s file is padded
    to its window and the 75 s file moves by its windows, segment for segment as transformers' generate, which reads
    the window from the same field."""
    import speech

    root, target, _, path = spoken_pair
    torch.manual_seed(3)
    short = WhisperForConditionalGeneration(WhisperConfig(**target.config.to_dict() | {"max_source_positions": 500}))
    short.eval().generation_config = target.generation_config
    short.save_pretrained(tmp_path / "hf")
    shutil.copy(root / "hf" / "tokenizer.json", tmp_path / "hf")
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    models = spoken_models(tmp_path)
    assert speech.window_frames(models.target) == 1000
    features = audio.log_mel(audio.read(path), 80, frames=1000)  # padded to the window
    assert features.shape == (1000, 80)
    theirs = generated(short, features, language="en", task="transcribe", return_timestamps=True, max_new_tokens=40)
    (transcription,) = speech.transcribe(models, [path], language="en", timestamps=True, max_tokens=40)
    assert ours(transcription) == theirs and sum(len(tokens) for _, _, tokens in theirs) >= 10
    theirs = generated(short, whole_features(long_file), language="en", task="transcribe", return_timestamps=True,
                       max_new_tokens=30)
    (transcription,) = speech.transcribe(models, [long_file], language="en", max_tokens=30)
    assert ours(transcription) == theirs
    assert len({segment["seek"] for segment in transcription.segments}) >= 3  # windows, each its own 10 s


def test_files_of_any_length_decode_together_each_as_it_does_alone(spoken_pair, long_file, monkeypatch):
    """Two long files and a short one in one batch: a file's next window joins
    as soon as its last ends, and each file's segments are what it gets alone."""
    import speech
    from rows import Batch

    root, _, _, path = spoken_pair
    models = spoken_models(root)
    shifted = audio.read(long_file)[7 * audio.SAMPLE_RATE :]
    files = [long_file, path, shifted]
    widths, real = [], Batch.join

    def join(self, requests, encoding=None):
        rows = real(self, requests, encoding)
        widths.append((len(requests), len(self.rows)))
        return rows

    monkeypatch.setattr(Batch, "join", join)
    together = speech.transcribe(models, files, language="en", timestamps=True, max_tokens=50)
    assert widths[0] == (3, 3) and len(widths) >= 3  # the files' first windows together, then the next ones
    for file, transcription in zip(files, together):
        (alone,) = speech.transcribe(models, [file], language="en", timestamps=True, max_tokens=50)
        assert ours(transcription) == ours(alone)
    assert len(together[0].segments) > len(together[1].segments)


@torch.no_grad()
def test_the_windows_figures_are_transformers_and_a_silent_window_is_skipped_by_its_threshold(spoken_pair, long_file):
    """Each window's no-speech probability (after its start of transcript,
    before any rule), average log-probability (after the rules, the end of
    text's included) and compression ratio are those transformers computes;
    with a no-speech threshold between the windows' probabilities (and a
    log-probability threshold every window is under), the windows above it
    are skipped, as transformers skips them."""
    import speech
    from transformers import WhisperForConditionalGeneration as Whisper

    root, target, ids, _ = spoken_pair
    models = spoken_models(root)
    features = whole_features(long_file)
    (plain,) = speech.transcribe(models, [long_file], language="en", max_tokens=60)
    windows = {segment["seek"]: segment for segment in plain.segments}
    opening = [ids[token] for token in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>")]
    for seek, segment in windows.items():
        window = features[seek : seek + audio.WINDOW_FRAMES]
        window = np.pad(window, [(0, audio.WINDOW_FRAMES - len(window)), (0, 0)])
        logits = target(torch.tensor(window.T[None]), decoder_input_ids=torch.tensor([opening])).logits[0, 0]
        expected = float(torch.softmax(logits, -1)[ids["<|nospeech|>"]])
        assert segment["no_speech_prob"] == pytest.approx(expected, rel=1e-4)
    out = target.generate(torch.tensor(features.T[None]), attention_mask=torch.ones(1, len(features), dtype=torch.long),
                          return_segments=True, logits_processor=[Margins()], language="en", task="transcribe",
                          return_timestamps=True, max_new_tokens=60, logprob_threshold=0.0, temperature=0.0)
    for theirs, mine in zip(out["segments"][0], plain.segments):
        result = theirs["result"]
        tokens = result["sequences"][len(opening):]
        expected = float(Whisper._retrieve_avg_logprobs(result["scores"], tokens, 0.0))
        assert mine["avg_logprob"] == pytest.approx(expected, abs=1e-4)
        assert mine["compression_ratio"] == pytest.approx(Whisper._retrieve_compression_ratio(tokens, 2609))
    probabilities = sorted({segment["no_speech_prob"] for segment in plain.segments})
    assert len(probabilities) >= 3
    threshold = (probabilities[-2] + probabilities[-1]) / 2  # the most silent-seeming window is skipped
    theirs = generated(target, features, language="en", task="transcribe", return_timestamps=True, max_new_tokens=60,
                       no_speech_threshold=threshold, logprob_threshold=0.0, temperature=0.0)
    guards = speech.Guards(no_speech_threshold=threshold, logprob_threshold=0.0)
    (skipping,) = speech.transcribe(models, [long_file], language="en", max_tokens=60, guards=guards)
    assert ours(skipping) == theirs and len(skipping.segments) < len(plain.segments)
    assert max(segment["no_speech_prob"] for segment in skipping.segments) < threshold


def test_a_window_failing_a_threshold_is_decoded_again_at_the_next_temperature(spoken_pair, long_file):
    """Temperature fallback: a window whose compression ratio is over the
    threshold is decoded again at the next temperature, until one passes (or
    the last, which is kept, as transformers keeps it); a threshold no window
    reaches keeps greedy."""
    import speech

    root, _, _, path = spoken_pair
    models = spoken_models(root)
    (greedy,) = speech.transcribe(models, [long_file], language="en", max_tokens=30)
    assert greedy.segments[0]["compression_ratio"] > 1.0  # (1.11: its first window fails a threshold of 1)
    temperatures = (0.0, 0.5, 1.0)
    every = speech.Guards(temperatures, compression_ratio_threshold=0.0)  # no window passes
    (redone,) = speech.transcribe(models, [path], language="en", timestamps=True, max_tokens=30, guards=every, seed=3)
    assert {segment["temperature"] for segment in redone.segments} == {1.0}
    (hotter,) = speech.transcribe(models, [long_file], language="en", max_tokens=30, seed=3,
                                  guards=speech.Guards(temperatures, compression_ratio_threshold=1.0))
    assert hotter.segments[0]["temperature"] == 0.5  # redone once, and passed (0.94 at seed 3)
    assert all(segment["compression_ratio"] <= 1.0 for segment in hotter.segments if segment["temperature"] < 1.0)
    calm = speech.Guards(temperatures, compression_ratio_threshold=1e9)
    (kept,) = speech.transcribe(models, [long_file], language="en", max_tokens=30, guards=calm)
    assert ours(kept) == ours(greedy) and {segment["temperature"] for segment in kept.segments} == {0.0}


# ---------------------------------------------------------------- the server's audio endpoints

ALIGNMENT_HEADS = [[1, 0], [2, 1], [2, 3]]  # the spoken fixture's, for word times


def with_alignment_heads(root, folder):
    """A copy of the spoken fixture whose generation config names alignment heads (the model is the same)."""
    import json

    if not (folder / "mlx").exists():
        shutil.copytree(root / "mlx", folder / "mlx")
        config = json.loads((folder / "mlx" / "generation_config.json").read_text())
        (folder / "mlx" / "generation_config.json").write_text(json.dumps(config | {"alignment_heads": ALIGNMENT_HEADS}))
    return folder


@pytest.fixture(scope="module")
def audio_server(spoken_pair):
    from serving.process import ServerProcess

    root, _, _, _ = spoken_pair
    timed = with_alignment_heads(root, root / "timed")
    running = ServerProcess("--model", str(timed / "mlx"), "--served-model-name", "whisper", "--max-batch", "4",
                            "--max-audio-mb", "4")
    yield running
    assert running.stop() == 0


def audio_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_server_transcribes_and_translates_through_openais_client_as_transcribe_does(spoken_pair, long_file,
                                                                                          audio_server):
    """OpenAI's client: verbose_json's segments are transcribe's (a long file
    window by window), json's text its text, srt its rendering; translations
    decode with <|translate|>; the metrics count the audio's seconds."""
    import speech

    root, _, _, path = spoken_pair
    models = spoken_models(root)
    client, before = audio_client(audio_server), audio_server.metrics()
    with open(long_file, "rb") as file:
        verbose = client.audio.transcriptions.create(model="whisper", file=file, language="en",
                                                     response_format="verbose_json", extra_body={"max_tokens": 40})
    (expected,) = speech.transcribe(models, [long_file], language="en", max_tokens=40)
    assert [(s.start, s.end, s.tokens, s.text) for s in verbose.segments] == \
        [(s["start"], s["end"], s["tokens"], s["text"]) for s in expected.segments]
    assert verbose.text == expected.text and verbose.language == "english" and verbose.duration == pytest.approx(75.005)
    with open(path, "rb") as file:
        plain = client.audio.transcriptions.create(model="whisper", file=file, language="en",
                                                   extra_body={"max_tokens": 20})
    (short,) = speech.transcribe(models, [path], language="en", max_tokens=20)
    assert plain.text == short.text
    with open(path, "rb") as file:
        srt = client.audio.transcriptions.create(model="whisper", file=file, language="en", response_format="srt",
                                                 extra_body={"max_tokens": 20})
    (timed,) = speech.transcribe(models, [path], language="en", timestamps=True, max_tokens=20)
    assert srt == speech.render(timed, "srt")
    with open(path, "rb") as file:
        translated = client.audio.translations.create(model="whisper", file=file, extra_body={"max_tokens": 20})
    (expected,) = speech.transcribe(models, [path], task="translate", max_tokens=20)
    assert translated.text == expected.text
    after = audio_server.metrics()
    assert after["vllm:audio_seconds_total"] - before.get("vllm:audio_seconds_total", 0) == pytest.approx(75.0048125 + 3 * 5.0)


def test_requests_transcribed_at_once_each_get_what_they_get_alone(spoken_pair, long_file, audio_server):
    from concurrent.futures import ThreadPoolExecutor

    import speech

    root, _, _, path = spoken_pair
    client = audio_client(audio_server)
    files = [long_file, path, long_file, path]

    def ask(file):
        with open(file, "rb") as opened:
            return client.audio.transcriptions.create(model="whisper", file=opened, language="en",
                                                      response_format="verbose_json", extra_body={"max_tokens": 30})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, files))
    models = spoken_models(root)
    for file, answer in zip(files, answers):
        (alone,) = speech.transcribe(models, [file], language="en", timestamps=True, max_tokens=30)
        assert [(s.start, s.end, s.tokens) for s in answer.segments] == ours(alone)


def test_the_servers_audio_stream_is_vllms_chunks_of_the_text_as_segments_are_decided(spoken_pair, long_file,
                                                                                     audio_server):
    import json

    import httpx

    import speech

    root, _, _, _ = spoken_pair
    with open(long_file, "rb") as file:
        with httpx.stream("POST", audio_server.url + "/v1/audio/transcriptions", timeout=120,
                          files={"file": ("long.wav", file, "audio/wav")},
                          data={"model": "whisper", "language": "en", "stream": "true", "max_tokens": "40",
                                "stream_include_usage": "true"}) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks if chunk["choices"])
    (expected,) = speech.transcribe(spoken_models(root), [long_file], language="en", max_tokens=40)
    assert text.strip() == expected.text and len([chunk for chunk in chunks if chunk["choices"]]) >= 3
    assert chunks[0]["object"] == "transcription.chunk"
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]][-1] == expected.finish_reason
    assert chunks[-1]["usage"]["completion_tokens"] == expected.stats.generated


def test_what_the_audio_endpoints_refuse_is_a_400_or_413_that_says_why(spoken_pair, tmp_path, audio_server):
    import httpx
    import openai

    root, _, _, path = spoken_pair
    client = audio_client(audio_server)
    (tmp_path / "notes.txt").write_text("not audio at all, just some words " * 10)
    cases = [((tmp_path / "notes.txt"), {}, "not an audio file this can read"),
             (path, {"language": "de"}, "unknown language 'de'"),
             (path, {"timestamp_granularities": ["word"]}, "word timestamps come in verbose_json"),
             (path, {"extra_body": {"max_tokens": 446}}, "max_tokens is 446")]
    for file, options, message in cases:
        with open(file, "rb") as opened, pytest.raises(openai.BadRequestError, match=message):
            client.audio.transcriptions.create(model="whisper", file=opened, **options)
    with pytest.raises(openai.NotFoundError):
        with open(path, "rb") as opened:
            client.audio.transcriptions.create(model="whisper-9", file=opened)
    response = httpx.post(audio_server.url + "/v1/audio/transcriptions", data={"model": "whisper"})
    assert response.status_code == 400 and "an audio file is required" in response.json()["error"]["message"]
    big = httpx.post(audio_server.url + "/v1/audio/transcriptions", data={"model": "whisper"},
                     files={"file": ("big.wav", b"\0" * (5 * 2**20), "audio/wav")})
    assert big.status_code == 413
    with pytest.raises(openai.BadRequestError, match="transcribes audio: POST /v1/audio/transcriptions"):
        client.completions.create(model="whisper", prompt="hello", max_tokens=5)


def test_a_prompt_opens_every_window_as_transformers_prompt_ids_do(spoken_pair, long_file, tmp_path):
    """<|startofprev|> and the prompt's tokens before each window's start of
    transcript (its no-speech probability read after that start), as
    transformers' generate(prompt_ids=...) decodes a long file."""
    import json

    import speech

    root, target, ids, _ = spoken_pair
    shutil.copytree(root / "mlx", tmp_path / "mlx")
    previous = ids["<|nospeech|>"]  # the fixture has no <|startofprev|>: a special token stands in for it
    config = json.loads((tmp_path / "mlx" / "generation_config.json").read_text())
    (tmp_path / "mlx" / "generation_config.json").write_text(json.dumps(config | {"prev_sot_token_id": previous}))
    models = spoken_models(tmp_path)
    prompt = "def area(self): return the width"
    (ours_,) = speech.transcribe(models, [long_file], language="en", max_tokens=40, prompt=prompt)
    (plain,) = speech.transcribe(models, [long_file], language="en", max_tokens=40)
    prompt_ids = torch.tensor([previous, *models.tokenizer.encode(" " + prompt, add_special_tokens=False)])
    theirs = generated(target, whole_features(long_file), language="en", task="transcribe", return_timestamps=True,
                       max_new_tokens=40, prompt_ids=prompt_ids)
    assert ours(ours_) == theirs != ours(plain)
    assert ours_.segments[0]["no_speech_prob"] != plain.segments[0]["no_speech_prob"]


def test_the_command_line_prints_a_files_segments_as_they_are_decided_with_the_guards_it_is_given(
        spoken_pair, long_file, capsys):
    import main
    import speech

    root, _, _, _ = spoken_pair
    models = spoken_models(root)
    (plain,) = speech.transcribe(models, [long_file], language="en", max_tokens=40)
    command = ["--model", str(root / "mlx"), "--audio", str(long_file), "--language", "en", "--max-tokens", "40",
               "--timestamps"]
    assert main.main(command) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[{s['start']:6.2f} -> {s['end']:6.2f}] {s['text']}" for s in plain.segments]
    threshold = sorted(segment["no_speech_prob"] for segment in plain.segments)[-1] - 1e-9
    assert main.main(command + ["--no-speech-threshold", str(threshold), "--logprob-threshold", "0"]) == 0
    fewer = capsys.readouterr().out.splitlines()
    assert 0 < len(fewer) < len(lines)
    assert main.main(command + ["--temperature-increment-on-fallback", "2"]) == 2
    assert "a step in (0, 1], not 2.0" in capsys.readouterr().err


@pytest.mark.parametrize("frames", [1, 29, 58, 116, 1499, 2999, 3000])
def test_a_windows_segments_and_its_move_are_transformers_retrieve_segments(frames):
    """Whisper.window_segments against transformers' own _retrieve_segment:
    pairs, a lone timestamp at the end, no pair, a last timestamp with no
    pair, text after the last pair; the move in frames and the times (its
    float32 frame count included) at a window's offset."""
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    from speech_tokens import Whisper

    whisper, first = Whisper(start=1, end=0, no_timestamps=9, vocabulary=1600), 10
    patterns = [[5, 6], [first + 3, 5, 6, first + 9], [first + 3, 5, first + 7, first + 8, 6, 7],
                [first + 2, 5, first + 7, first + 8, 6, first + 20], [5, first + 30], [],
                [first + 1, 5, 6, first + 5, first + 6, 8, first + 9, first + 10]]
    for seek in (0, 2966, 41_017):
        for tokens in patterns:
            offset = torch.tensor([seek], dtype=torch.float64) * 0.02 / 2
            theirs, move = WhisperGenerationMixin._retrieve_segment(
                torch.tensor(tokens, dtype=torch.long), [{}], offset, first, torch.tensor([frames]), 0.02, 0.01, 2, 0, 0,
                False, torch.zeros(1, 3))
            mine, advance = whisper.window_segments(tokens, seek * 0.02 / 2, frames)
            assert [(segment["start"], segment["end"], segment["tokens"]) for segment in mine] == \
                [(float(segment["start"]), float(segment["end"]), segment["tokens"].tolist()) for segment in theirs]
            assert advance == int(move)


def test_a_long_file_is_refused_as_soon_as_its_decoding_passes_the_limit(spoken_pair, long_file):
    """audio.read's max_seconds: a WAV by its header, any other format as PyAV decodes it (it stops there)."""
    samples = audio.read(long_file)
    flac = encoded_as(samples, audio.SAMPLE_RATE, 1, "flac", "flac")
    for data in (long_file.read_bytes(), flac):
        assert len(audio.read(data, max_seconds=80)) == len(samples)
        with pytest.raises(audio.AudioError, match="the audio is longer than the 60 s this accepts"):
            audio.read(data, max_seconds=60)


def test_a_file_of_silence_whose_every_window_is_skipped_has_no_segments(spoken_pair):
    """With a no-speech threshold of 0 and a log-probability threshold of 0
    (every window is under it), every window of a long file is skipped: no
    text, no segments, nothing streamed."""
    import speech

    root, _, _, _ = spoken_pair
    silence = np.zeros(70 * audio.SAMPLE_RATE, np.float32)
    models = spoken_models(root)
    (heard,) = speech.transcribe(models, [silence], language="en", max_tokens=20)
    assert heard.segments
    guards = speech.Guards(no_speech_threshold=0.0, logprob_threshold=0.0)
    (skipped,) = speech.transcribe(models, [silence], language="en", max_tokens=20, guards=guards)
    assert skipped.segments == [] and skipped.text == "" and skipped.stats.generated > 0
    assert list(speech.stream_transcribe(models, silence, language="en", max_tokens=20, guards=guards)) == []


def test_a_client_that_leaves_mid_file_stops_its_windows_and_the_server_goes_on(spoken_pair, long_file, audio_server):
    """A client gone while its long file decodes: its job ends as "abort" (counted once), no next window is
    decoded for it, and the next request is answered as before."""
    import httpx

    root, _, _, path = spoken_pair
    before = audio_server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        with open(long_file, "rb") as file:
            httpx.post(audio_server.url + "/v1/audio/transcriptions", timeout=httpx.Timeout(10, read=0.5),
                       files={"file": ("long.wav", file, "audio/wav")},
                       data={"model": "whisper", "language": "en", "response_format": "verbose_json"})
    deadline, key = time.time() + 60, 'vllm:request_success_total{finished_reason="abort"}'
    while audio_server.metrics().get(key, 0) == before.get(key, 0) and time.time() < deadline:
        time.sleep(0.1)
    after = audio_server.metrics()
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert sum(v for k, v in after.items() if k.startswith("vllm:request_success_total")) == \
        sum(v for k, v in before.items() if k.startswith("vllm:request_success_total")) + 1
    with open(path, "rb") as file:
        answer = audio_client(audio_server).audio.transcriptions.create(model="whisper", file=file, language="en",
                                                                        extra_body={"max_tokens": 10})
    assert answer.text


@torch.no_grad()
def test_word_times_are_transformers_token_timestamps_within_a_step(spoken_pair, long_file, tmp_path):
    """With words: each token's time (the alignment heads' cross-attention,
    normalised, median-filtered, averaged, then dynamic time warping) is
    transformers' return_token_timestamps (to float rounding), window by
    window of a long file, and of a short one whose attention mask cuts the
    window's padding; words run from their first token's time to the next
    token's, and spell the segment's text."""
    import copy

    import speech

    root, target, _, path = spoken_pair
    heads = ALIGNMENT_HEADS
    with_alignment_heads(root, tmp_path)
    features, kept = whole_features(long_file), target.generation_config
    target.generation_config = copy.deepcopy(kept)
    target.generation_config.alignment_heads = heads
    try:
        out = target.generate(torch.tensor(features.T[None]), attention_mask=torch.ones(1, len(features), dtype=torch.long),
                              return_segments=True, return_timestamps=True, return_token_timestamps=True,
                              logits_processor=[Margins()], language="en", task="transcribe", max_new_tokens=40)
    finally:
        target.generation_config = kept
    theirs = out["segments"][0]
    (heard,) = speech.transcribe(spoken_models(tmp_path), [long_file], language="en", max_tokens=40, words=True)
    assert [(s["start"], s["end"], s["tokens"]) for s in heard.segments] == \
        [(round(float(s["start"]), 2), round(float(s["end"]), 2), s["tokens"].tolist()) for s in theirs]
    for mine, their in zip(heard.segments, theirs):
        assert len(mine["token_times"]) == len(their["token_timestamps"])
        assert np.abs(np.array(mine["token_times"]) - their["token_timestamps"].numpy()).max() <= 1e-4
        assert "".join(word["word"] for word in mine["words"]) == mine["text"].replace(" ", "")
    words = [word for segment in heard.segments for word in segment["words"]]
    assert len(words) >= 5 and all(word["start"] <= word["end"] for word in words) and heard.words == words
    samples = audio.read(path)
    short = audio.log_mel(samples, 80)
    mask = torch.zeros(1, len(short), dtype=torch.long)
    mask[0, : -(-len(samples) // audio.HOP)] = 1  # the frames that hold audio, as the feature extractor marks them
    target.generation_config = copy.deepcopy(kept)
    target.generation_config.alignment_heads = heads
    try:
        out = target.generate(torch.tensor(short.T[None]), attention_mask=mask, return_segments=True,
                              return_timestamps=True, return_token_timestamps=True, logits_processor=[Margins()],
                              language="en", task="transcribe", max_new_tokens=40)
    finally:
        target.generation_config = kept
    (heard,) = speech.transcribe(spoken_models(tmp_path), [path], language="en", max_tokens=40, timestamps=True,
                                 words=True)
    first, theirs = heard.segments[0], out["segments"][0][0]
    assert first["tokens"] == theirs["tokens"].tolist() and len(first["tokens"]) >= 3
    assert np.abs(np.array(first["token_times"]) - theirs["token_timestamps"].numpy()).max() <= 1e-4
    with pytest.raises(speech.OptionError, match="names no alignment_heads"):
        speech.transcribe(spoken_models(root), [long_file], words=True)


def test_the_server_gives_openais_words_as_transcribe_times_them(spoken_pair, long_file, audio_server):
    import speech

    root, _, _, _ = spoken_pair
    with open(long_file, "rb") as file:
        verbose = audio_client(audio_server).audio.transcriptions.create(
            model="whisper", file=file, language="en", response_format="verbose_json",
            timestamp_granularities=["word", "segment"], extra_body={"max_tokens": 30})
    timed = with_alignment_heads(root, root / "timed")
    (expected,) = speech.transcribe(spoken_models(timed), [long_file], language="en", max_tokens=30, words=True)
    words = [word for segment in expected.segments for word in segment["words"]]
    assert [(word.word, word.start, word.end) for word in verbose.words] == \
        [(word["word"], word["start"], word["end"]) for word in words]
    assert len(words) >= 5 and [s.text for s in verbose.segments] == [s["text"] for s in expected.segments]


def test_the_command_line_prints_each_words_times_under_its_segment(spoken_pair, long_file, capsys):
    import main
    import speech

    root, _, _, _ = spoken_pair
    timed = with_alignment_heads(root, root / "timed")
    (expected,) = speech.transcribe(spoken_models(timed), [long_file], language="en", max_tokens=30, words=True)
    assert main.main(["--model", str(timed / "mlx"), "--audio", str(long_file), "--language", "en", "--max-tokens",
                      "30", "--timestamps", "--word-timestamps"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected_lines = []
    for segment in expected.segments:
        expected_lines.append(f"[{segment['start']:6.2f} -> {segment['end']:6.2f}] {segment['text']}")
        expected_lines += [f"    [{w['start']:6.2f} -> {w['end']:6.2f}] {w['word']}" for w in segment["words"]]
    assert lines == expected_lines and any(line.startswith("    [") for line in lines)


@pytest.fixture(scope="module")
def spoken_draft(spoken_pair):
    """The spoken fixture's distil-style draft: its target's encoder and its first and last decoder layers."""
    root, _, _, _ = spoken_pair
    state = load_file(str(root / "hf" / "model.safetensors"))
    draft_state = {name.replace("model.decoder.layers.2.", "model.decoder.layers.1."): tensor
                   for name, tensor in state.items() if not name.startswith("model.decoder.layers.1.")}
    (root / "hf_draft").mkdir()
    for file in (root / "hf").iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, root / "hf_draft" / file.name)
    config = WhisperConfig.from_pretrained(root / "hf")
    config.decoder_layers = 2
    config.save_pretrained(root / "hf_draft")
    save_file(draft_state, str(root / "hf_draft" / "model.safetensors"), metadata={"format": "pt"})
    convert.convert(str(root / "hf_draft"), root / "mlx_draft", "float32", force=False)
    return root / "mlx_draft"


@torch.no_grad()
def processed_distribution(model, features: np.ndarray, ids: list[int], opened: int) -> np.ndarray:
    """transformers' next-token distribution at temperature 1 after ids, through its Whisper processors in
    generate's order (those suppressed at the start, the config's suppressed tokens, the timestamps')."""
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                         SuppressTokensLogitsProcessor,
                                                         WhisperTimeStampLogitsProcessor)

    generation = model.generation_config
    logits = model(torch.tensor(features.T[None]), decoder_input_ids=torch.tensor([ids])).logits[:, -1]
    for processor in (SuppressTokensAtBeginLogitsProcessor(generation.begin_suppress_tokens, opened),
                      SuppressTokensLogitsProcessor(generation.suppress_tokens),
                      WhisperTimeStampLogitsProcessor(generation, begin_index=opened)):
        logits = processor(torch.tensor([ids]), logits)
    return torch.softmax(logits[0].double(), -1).numpy()


def test_sampled_drafting_on_whisper_follows_the_targets_distribution_with_its_rules(spoken_pair, spoken_draft):
    """Speculative sampling at temperature 1 and delta 0, with timestamps, a
    distil-style draft following the same rules (up to 3 drafts a round): the
    first token's distribution (a timestamp no later than the first's limit),
    and the second's after the likeliest first (drafted, or the target's
    correction), pass a chi-square test against transformers' with its
    processors; drafts are both accepted and rejected. 1,500 samples: with a
    rejected draft resampled from the target instead of the residual, 2,000
    gave the first token a chi-square of 102 against 22.5."""
    from options import Stats
    from speech_tokens import Whisper

    root, target, ids, path = spoken_pair
    models = Models(load_model(root / "mlx"), load_model(spoken_draft), tokenizer=load_tokenizer(root / "mlx"),
                    generation=read_generation_config(root / "mlx"))
    whisper = Whisper.of(models)
    opening = whisper.opening(ids["<|en|>"], "transcribe", timestamps=True)
    features = audio.log_mel(audio.read(path), 80)
    source = mx.array(features)  # one array: the requests encode it once
    settings = Settings(max_tokens=4, temp=1.0, num_draft=3, delta=0.0)
    requests = [Request(source, Settings(**{**settings.__dict__, "seed": i}), opening=opening,
                        rules=whisper.rules(opening, timestamps=True)) for i in range(1500)]
    tokens, _ = decode_batch(models, requests, 500)
    totals = sum((request.stats for request in requests), Stats())
    assert 0.05 < totals.acceptance_rate < 0.95

    def grouped(counts: dict, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens, likeliest first, in 7 groups of about a seventh of the probability each; the impossible apart."""
        order = np.argsort(-expected)
        group = np.minimum((np.cumsum(expected[order]) - expected[order] / 2) * 7, 6).astype(int)
        of = dict(zip(order.tolist(), group.tolist()))
        observed = np.bincount([of[token] for token, n in counts.items() for _ in range(n)], minlength=7)
        return observed, np.bincount(group, weights=expected[order], minlength=7)

    opened = len(opening.start)
    first_expected = processed_distribution(target, features, list(opening.start), opened)
    firsts = {}
    for out in tokens:
        firsts[out[0]] = firsts.get(out[0], 0) + 1
    first_timestamp = ids["<|notimestamps|>"] + 1
    assert all(first_timestamp <= token <= first_timestamp + 50 for token in firsts)
    assert (first_expected > 0).sum() >= 20 and chi_square_passes(*grouped(firsts, first_expected))
    first = max(firsts, key=firsts.get)
    second_expected = processed_distribution(target, features, list(opening.start) + [first], opened)
    seconds = {}
    for out in tokens:
        if out[0] == first and len(out) > 1:
            seconds[out[1]] = seconds.get(out[1], 0) + 1
    assert not set(seconds) & set(SUPPRESSED)
    assert chi_square_passes(*grouped(seconds, second_expected))


def test_conditioned_on_the_text_before_each_window_opens_as_transformers_condition_on_prev_tokens(spoken_pair,
                                                                                                  long_file):
    """condition: each window after the first opens with <|startofprev|> (the
    config's, or the second-last suppressed token, as transformers falls back
    to) and the last 223 tokens of the segments before it (a closing pair of
    timestamps one token shorter), as transformers' generate with
    condition_on_prev_tokens; with a prompt, the prompt's tokens come first."""
    import speech

    root, target, _, _ = spoken_pair
    models = spoken_models(root)
    features = whole_features(long_file)
    theirs = generated(target, features, language="en", task="transcribe", return_timestamps=True, max_new_tokens=40,
                       condition_on_prev_tokens=True)
    (conditioned,) = speech.transcribe(models, [long_file], language="en", max_tokens=40, condition=True)
    (plain,) = speech.transcribe(models, [long_file], language="en", max_tokens=40)
    assert ours(conditioned) == theirs != ours(plain)
    assert conditioned.segments[0]["tokens"] == plain.segments[0]["tokens"]  # the first window: nothing before it


def test_words_come_from_whole_characters_with_their_marks_as_openai_whisper_joins_them():
    """A leading space starts a word; a closing mark joins the word before, an
    opening one (even after a space) the word after; a character whose bytes
    two tokens split is one; a language without spaces has a word a
    character."""
    from speech_tokens import words_of

    class Bytes:  # a tokenizer whose tokens are byte strings
        def __init__(self, pieces):
            self.pieces = pieces

        def decode(self, ids):
            return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    said = [b" He", b" said", b' "', b"Hello", b'"', b".", b" \xe6\x97", b"\xa5", b"!", b" ok"]
    tokenizer, times = Bytes(said), [float(i) for i in range(len(said) + 1)]
    words = words_of(list(range(len(said))), times, tokenizer, end=100)
    assert [(w["word"], w["start"], w["end"]) for w in words] == [
        ("He", 0, 1), ("said", 1, 2), ('"Hello".', 2, 6), ("日!", 6, 9), ("ok", 9, 10)]
    chinese = Bytes([b"\xe4\xbd\xa0", b"\xe5\xa5", b"\xbd", b"\xef\xbc\x8c", b"\xe4\xb8\x96"])
    words = words_of([0, 1, 2, 3, 4, 200], [0.0, 1, 2, 3, 4, 5, 6], chinese, end=100, spaceless=True)
    assert [(w["word"], w["start"], w["end"]) for w in words] == [("你", 0, 1), ("好，", 1, 4), ("世", 4, 5)]


# ---------------------------------------------------------------- beam search

@pytest.fixture
def beam_margins(monkeypatch):
    """Asserts that every step of every beam search ranks its candidates (beam
    score plus token log-probability) by margins of 1e-4 or more: ten times
    what ours and transformers' differ by, so that both rank them alike."""
    import beams

    step = beams.Search.step

    def checked(search, scores, *args, **kwargs):
        ranked = np.sort(scores[scores > beams.NONE / 2])[::-1]
        assert (np.diff(-ranked) > 1e-4).all()
        return step(search, scores, *args, **kwargs)

    monkeypatch.setattr(beams.Search, "step", checked)


@torch.no_grad()
def beam_generated(model, features: np.ndarray, **options) -> list:
    """transformers' Whisper generate's segments on a file's whole features (with their sequences_scores)."""
    out = model.generate(torch.tensor(features.T[None]), attention_mask=torch.ones(1, len(features), dtype=torch.long),
                         return_segments=True, language="en", task="transcribe", **options)
    return out["segments"][0]


def segments_of(theirs) -> list[tuple[float, float, list[int]]]:
    return [(round(float(s["start"]), 2), round(float(s["end"]), 2), s["tokens"].tolist()) for s in theirs]


@pytest.mark.parametrize("timestamps", [False, True])
def test_beam_search_on_whisper_is_transformers_with_whispers_rules(spoken_pair, beam_margins, timestamps):
    """num_beams 3 on a 5 s file: the beams follow the suppressions and the
    timestamp rules as transformers' beam search applies them (to the
    log-probabilities), and the file decodes as its generate does, segment
    for segment, each window's avg_logprob its best beam's sequences_score.
    (This random model writes pairs of timestamps even without them asked
    for; both then move on by them, as long-form does.) Greedy decodes it
    otherwise: the beams are searched."""
    import speech

    root, target, _, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    theirs = beam_generated(target, features, num_beams=3, max_new_tokens=40, return_timestamps=timestamps)
    (searched,) = speech.transcribe(spoken_models(root), [path], language="en", max_tokens=40, num_beams=3,
                                    timestamps=timestamps)
    assert ours(searched) == segments_of(theirs) and len(searched.segments) >= 2
    (greedy,) = speech.transcribe(spoken_models(root), [path], language="en", max_tokens=40, timestamps=timestamps)
    assert greedy.tokens != searched.tokens


def test_a_long_file_beam_searched_is_transformers_long_form_with_its_words(spoken_pair, long_file, beam_margins,
                                                                           tmp_path, capsys):
    """Beams over a long file decoded beside a short one, window by window,
    with word times: segments, each window's avg_logprob (the kept beam's
    tokens' log-probabilities after the rules, as transformers' guards read
    its scores: not its sequences_scores) and token times are transformers' (its beam_indices
    gather the cross-attention of the beam kept; every beam of a window
    shares it); the command line's --num-beams decodes the same, and loads
    no draft for it."""
    import copy

    import main
    import speech

    root, target, _, _ = spoken_pair
    with_alignment_heads(root, tmp_path)
    features, kept = whole_features(long_file), target.generation_config
    target.generation_config = copy.deepcopy(kept)
    target.generation_config.alignment_heads = ALIGNMENT_HEADS
    try:
        theirs = beam_generated(target, features, num_beams=3, max_new_tokens=40, return_timestamps=True,
                                return_token_timestamps=True)
    finally:
        target.generation_config = kept
    _, searched = speech.transcribe(spoken_models(tmp_path), [spoken_pair[3], long_file], language="en", max_tokens=40,
                                    num_beams=3, words=True)  # (the second file's beams are rows 3 to 5)
    assert ours(searched) == segments_of(theirs) and len({s["seek"] for s in searched.segments}) >= 3
    for mine, their in zip(searched.segments, theirs):
        assert np.abs(np.array(mine["token_times"]) - their["token_timestamps"].numpy()).max() <= 1e-4
        result = their["result"]  # (transformers' guards read its scores, the beam kept's, not sequences_scores)
        expected = float(WhisperForConditionalGeneration._retrieve_avg_logprobs(result["scores"], result["sequences"], 0.0))
        assert mine["avg_logprob"] == pytest.approx(expected, abs=1e-4)
    (greedy,) = speech.transcribe(spoken_models(root), [long_file], language="en", max_tokens=40)
    assert greedy.tokens != searched.tokens
    assert main.main(["--model", str(root / "mlx"), "--draft-model", "nowhere", "--audio", str(long_file),
                      "--language", "en", "--max-tokens", "40", "--num-beams", "3", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(s["start"], s["end"], s["tokens"]) for s in printed["segments"]] == ours(searched)


def test_a_beam_searched_window_that_fails_a_threshold_is_sampled_again_with_one_beam(spoken_pair, long_file,
                                                                                       monkeypatch):
    """As transformers' fallback: the guards read a beam-searched window's
    avg_logprob (its kept beam's), and a temperature above 0 samples, so a
    window decoded again hotter has one beam; the windows after it are
    beam-searched again (as openai-whisper's and faster-whisper's are;
    transformers' stays at one beam for the rest of its call)."""
    import speech

    root, _, _, _ = spoken_pair
    models = spoken_models(root)
    (searched,) = speech.transcribe(models, [long_file], language="en", max_tokens=30, num_beams=2)
    scores = {segment["seek"]: segment["avg_logprob"] for segment in searched.segments}  # each window's
    first, others = scores[0], [score for seek, score in scores.items() if seek]
    threshold = (first + min(others)) / 2  # the first window fails it, the others pass
    assert first < threshold < min(others)
    decoded, window = [], speech.Listening.window

    def recorded(listening, track):
        request = window(listening, track)
        decoded.append((track.seek, request.settings.temp, request.settings.num_beams))
        return request

    monkeypatch.setattr(speech.Listening, "window", recorded)
    guards = speech.Guards(temperatures=(0.0, 0.8), logprob_threshold=threshold)
    (guarded,) = speech.transcribe(models, [long_file], language="en", max_tokens=30, num_beams=2, guards=guards,
                                   seed=2)
    assert decoded[:2] == [(0, 0.0, 2), (0, 0.8, 1)] and all(beams == 2 for _, temp, beams in decoded if temp == 0)
    assert {segment["temperature"] for segment in guarded.segments} == {0.0, 0.8}
    assert all(segment["avg_logprob"] >= threshold for segment in guarded.segments if segment["temperature"] == 0.0)


def test_the_server_beam_searches_audio_with_openai_whispers_beam_size(spoken_pair, long_file, audio_server):
    """beam_size (openai-whisper's and faster-whisper's field, 1 to 16) over
    the server's defaults: the request decodes as transcribe with num_beams;
    with a temperature above 0 it samples, with one beam, as openai-whisper
    does; out of range it is a 400 that names it."""
    import openai

    import speech

    root, _, _, _ = spoken_pair
    client = audio_client(audio_server)
    with open(long_file, "rb") as file:
        verbose = client.audio.transcriptions.create(model="whisper", file=file, language="en",
                                                     response_format="verbose_json",
                                                     extra_body={"max_tokens": 30, "beam_size": 3})
    (expected,) = speech.transcribe(spoken_models(root), [long_file], language="en", max_tokens=30, num_beams=3)
    assert [(s.start, s.end, s.tokens) for s in verbose.segments] == ours(expected)
    with open(long_file, "rb") as file:
        sampled = client.audio.transcriptions.create(model="whisper", file=file, language="en", temperature=0.6,
                                                     response_format="verbose_json",
                                                     extra_body={"max_tokens": 30, "beam_size": 3, "seed": 4})
    (expected,) = speech.transcribe(spoken_models(root), [long_file], language="en", max_tokens=30, temp=0.6, seed=4)
    assert [(s.start, s.end, s.tokens) for s in sampled.segments] == ours(expected)  # sampling: one beam
    for size in (0, 17):
        with open(long_file, "rb") as file, pytest.raises(openai.BadRequestError, match="beam_size"):
            client.audio.transcriptions.create(model="whisper", file=file, extra_body={"beam_size": size})
