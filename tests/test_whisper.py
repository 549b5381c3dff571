"""Whisper: converted from transformers' checkpoints, fed log-mel features made as transformers makes them, from
audio files of any common format, and decoded token for token as transformers decodes, with and without a draft
that decodes on the target's encoder output."""

import io
import shutil
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support import decode_batch
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
    models = Models(load_model(root / "mlx"), load_model(root / "mlx") if drafted else None,
                    tokenizer=load_tokenizer(root / "mlx"), generation=read_generation_config(root / "mlx"))
    (transcription,) = speech.transcribe(models, [path], language="en", max_tokens=40, speculative=drafted,
                                         num_draft=3, delta=0.0)
    assert transcription.tokens == expected and transcription.language == "en"
    assert transcription.duration == pytest.approx(5.0)
    assert transcription.text == models.tokenizer.decode(expected, skip_special_tokens=True).strip()
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
    opening = [ids["<|startoftranscript|>"], detected, ids["<|transcribe|>"], ids["<|notimestamps|>"]]
    assert transcription.tokens == reference_transcription(target, features, opening, 20)


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


def test_the_command_line_transcribes_files_and_prints_openais_verbose_json(spoken_pair, tmp_path, capsys):
    import json

    import main

    root, target, ids, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    opening = [ids[token] for token in ("<|startoftranscript|>", "<|fr|>", "<|transcribe|>", "<|notimestamps|>")]
    expected = reference_transcription(target, features, opening, 12)
    assert main.main(["--model", str(root / "mlx"), "--audio", str(path), str(path), "--language", "fr",
                      "--max-tokens", "12", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2 and records[0] == records[1]
    assert records[0]["language"] == "fr" and records[0]["duration"] == 5.0
    (segment,) = records[0]["segments"]
    assert segment["tokens"] == expected and segment["start"] == 0.0 and segment["end"] == 5.0
    (tmp_path / "notes.txt").write_text("not audio at all, just some words " * 10)
    assert main.main(["--model", str(root / "mlx"), "--audio", str(tmp_path / "notes.txt")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "notes.txt: not an audio file this can read" in error
    assert error.count("\n") == 1
    assert main.main(["--audio", str(path)]) == 2
    assert "--audio needs --model" in capsys.readouterr().err


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
    assert transcription.tokens == expected
    segments = transcription.segments
    assert segments and all(0 <= segment["start"] <= segment["end"] <= 30 for segment in segments)
    assert [token for segment in segments for token in segment["tokens"]] == [t for t in expected if t < first]


def test_by_default_the_output_takes_the_positions_the_opening_leaves(spoken_pair):
    """As transformers' max_length of 448 does: 444 tokens after an opening of 4, 445 after 3 (timestamps)."""
    import speech

    root, _, _, path = spoken_pair
    models = Models(load_model(root / "mlx"), tokenizer=load_tokenizer(root / "mlx"),
                    generation=read_generation_config(root / "mlx"))
    for timestamps, most in ((False, 444), (True, 445)):
        (transcription,) = speech.transcribe(models, [path], language="en", timestamps=timestamps)
        assert len(transcription.tokens) == most and transcription.finish_reason == "length"  # no end of text comes


def test_a_transcription_renders_in_each_of_openais_response_formats():
    import json

    import speech
    from options import Stats

    segments = [{"start": 0.0, "end": 2.5, "text": " Hello there.", "tokens": [3, 4]},
                {"start": 2.5, "end": 3725.5, "text": " A long one.", "tokens": [5]}]
    heard = speech.Transcription("Hello there. A long one.", [3, 4, 5], "en", 3726.0, "stop", Stats(), segments)
    assert speech.render(heard, "text") == "Hello there. A long one.\n"
    assert json.loads(speech.render(heard, "json")) == {"text": "Hello there. A long one."}
    verbose = json.loads(speech.render(heard, "verbose_json"))
    assert verbose["language"] == "en" and verbose["duration"] == 3726.0 and verbose["segments"][1]["id"] == 1
    assert speech.render(heard, "srt") == ("1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
                                           "2\n00:00:02,500 --> 01:02:05,500\nA long one.\n")
    assert speech.render(heard, "vtt") == ("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
                                           "00:00:02.500 --> 01:02:05.500\nA long one.\n")


def test_the_command_line_writes_subtitles_beside_each_other_in_a_folder(spoken_pair, tmp_path, capsys):
    """--output-format srt turns timestamps on; --output-dir names each file after its audio."""
    import main

    root, target, ids, path = spoken_pair
    features = audio.log_mel(audio.read(path), 80)
    opening = [ids[token] for token in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>")]
    expected = reference_transcription(target, features, opening, 30, timestamps=True)
    assert main.main(["--model", str(root / "mlx"), "--audio", str(path), "--language", "en", "--max-tokens", "30",
                      "--output-format", "srt", "--output-dir", str(tmp_path)]) == 0
    written = (tmp_path / "tone.srt").read_text()
    first = ids["<|notimestamps|>"] + 1
    pairs = sum(1 for a, b in zip(expected, expected[1:]) if a >= first and b < first)  # a timestamp, then text
    assert written.startswith("1\n00:00:") and written.count(" --> ") == pairs >= 2
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
                               history=[[start, *before]])
        np.testing.assert_allclose(np.array(ours)[0, 0], theirs[0].numpy())
        assert int(theirs[0].argmax()) >= 12  # a timestamp forced: the check saw the suppressed token gone


def test_a_files_segments_stream_as_their_closing_timestamps_are_decided(spoken_pair, monkeypatch):
    """stream_transcribe yields transcribe's segments, each as soon as the
    timestamp that closes it is out: the first long before decoding ends."""
    import speech

    root, _, _, path = spoken_pair
    models = Models(load_model(root / "mlx"), tokenizer=load_tokenizer(root / "mlx"),
                    generation=read_generation_config(root / "mlx"))
    (whole,) = speech.transcribe(models, [path], language="en", timestamps=True, max_tokens=40)
    events, real = [], speech.Listening.events

    def counted(self):
        for event in real(self):
            events.append(event)
            yield event

    monkeypatch.setattr(speech.Listening, "events", counted)
    streamed, decided = [], []
    for segment in speech.stream_transcribe(models, path, language="en", max_tokens=40):
        streamed.append(segment)
        decided.append(len(events))
    assert streamed == whole.segments and len(streamed) >= 2
    assert decided[0] < len(events) // 2
