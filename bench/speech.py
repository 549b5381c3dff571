"""Whisper: `whisper`, the real-time factor of transcribing espeak-ng's speech (30 s, and 5 minutes as long-form
windows) at Whisper's shapes, with its real vocabulary and rules and random weights, ours against transformers'
generate on the same checkpoint (in a process of its own), alternating; each file's tokens checked equal."""

import codecs
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np

from bench.harness import Worker, alternate, table, warm_up_note

# Whisper's published shapes (tiny, small, large-v3-turbo), as their configs give them.
SHAPES = {
    "tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
                 encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80),
    "small": dict(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, num_mel_bins=80),
    "large-v3-turbo": dict(d_model=1280, encoder_layers=32, decoder_layers=4, encoder_attention_heads=20,
                           decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128),
}
SECONDS = (30, 300)  # a window, and a long file
WINDOW_TOKENS = 100  # tokens a window decodes at most (about what 30 s of speech takes), both sides
INIT_STD = 0.2  # random weights of varied greedy output (at tiny's shapes, ours and transformers' tokens are equal)


def speech(folder: Path) -> dict[int, Path]:
    """espeak-ng's speech of the Zen of Python, over and over, as 16 kHz WAV files of each length in SECONDS."""
    import audio

    paths = {seconds: folder / f"speech-{seconds}s.wav" for seconds in SECONDS}
    if all(path.exists() for path in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):  # (the module prints its text, rot13 in this.s, on import)
        import this
    text = codecs.decode(this.s, "rot13")
    said = folder / "zen.wav"
    subprocess.run(["espeak-ng", "-w", str(said), text], check=True)
    once = audio.read(said)
    samples = np.tile(once, -(-max(SECONDS) * audio.SAMPLE_RATE // len(once)))
    for seconds, path in paths.items():
        with wave.open(str(path), "wb") as file:
            file.setnchannels(1), file.setsampwidth(2), file.setframerate(audio.SAMPLE_RATE)
            file.writeframes((np.clip(samples[: seconds * audio.SAMPLE_RATE], -1, 1) * 32767).astype(np.int16).tobytes())
    return paths


def checkpoint(folder: Path, shape: str) -> tuple[Path, Path]:
    """(Hugging Face, converted) folders of a random Whisper of the shape, with the real vocabulary and a generation
    config as Hugging Face publishes large-v2's (its languages, tasks, suppressed tokens)."""
    hf, mlx = folder / f"whisper-{shape}", folder / f"whisper-{shape}-mlx"
    if not (mlx / "config.json").exists():
        import torch
        from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

        import convert
        from checkpoints import openai_whisper_tokenizer, save_whisper_vocabulary

        print(f"building a random Whisper of {shape} shapes in {hf} ...", file=sys.stderr)
        reference = save_whisper_vocabulary(hf)
        ids, languages = reference.encoding._special_tokens, openai_whisper_tokenizer()[0].LANGUAGES
        config = WhisperConfig(vocab_size=51865, max_source_positions=1500, max_target_positions=448, pad_token_id=50257,
                               bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258,
                               begin_suppress_tokens=None, init_std=INIT_STD, **SHAPES[shape])
        torch.manual_seed(0)
        model = WhisperForConditionalGeneration(config).eval()
        model.generation_config = GenerationConfig(
            decoder_start_token_id=50258, eos_token_id=50257, pad_token_id=50257, bos_token_id=50257,
            is_multilingual=True, lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in languages if f"<|{code}|>" in ids},
            task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
            no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
            suppress_tokens=list(reference.non_speech_tokens), begin_suppress_tokens=[220, 50257],
            max_initial_timestamp_index=50, max_length=448)
        model.save_pretrained(hf)
        WhisperFeatureExtractor(feature_size=SHAPES[shape]["num_mel_bins"]).save_pretrained(hf)
        convert.convert(str(hf), mlx, "float32", force=True)
    return hf, mlx


def whisper_worker(folder: str) -> None:
    """Persistent transformers process: one transcription per input line (JSON: a 16 kHz WAV file, a window's most
    tokens), as a user calls generate: features of the whole file, long-form with timestamps past 30 s."""
    import torch
    import transformers
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    model = WhisperForConditionalGeneration.from_pretrained(folder).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    print(json.dumps({"ready": f"transformers {transformers.__version__}, PyTorch {torch.__version__}"}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        with wave.open(request["file"]) as file:
            samples = np.frombuffer(file.readframes(file.getnframes()), np.int16).astype(np.float32) / 32768
        long = len(samples) > 30 * 16_000
        features = extractor(samples, sampling_rate=16_000, return_tensors="pt", return_attention_mask=True,
                             **(dict(truncation=False, padding="longest") if long else {}))
        with torch.no_grad():
            out = model.generate(features.input_features, attention_mask=features.attention_mask, language="en",
                                 task="transcribe", return_timestamps=long, return_segments=True,
                                 max_new_tokens=request["tokens"])
        tokens = [token for segment in out["segments"][0] for token in segment["tokens"].tolist()]
        print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}), flush=True)


def run_whisper(args) -> dict:
    import speech as ours_speech
    from loading import load

    shapes = args.shapes.split(",") if args.shapes else ["tiny", "small"]
    files, rows = speech(args.dir / "whisper-speech"), []
    for shape in shapes:
        hf, mlx = checkpoint(args.dir, shape)
        models, reference = load(str(mlx), one_row=True), Worker("--whisper-worker", str(hf))  # one file: one row, as main.py

        def ours(path):
            start = time.perf_counter()
            (transcription,) = ours_speech.transcribe(models, [path], language="en", max_tokens=WINDOW_TOKENS)
            return time.perf_counter() - start, transcription.tokens

        def theirs(path):
            answer = reference.ask({"file": str(path), "tokens": WINDOW_TOKENS})
            return answer["seconds"], answer["tokens"]

        for seconds, path in files.items():
            timings = alternate({"ours": lambda: ours(path), "transformers": lambda: theirs(path)}, args.repeats)
            rows.append({"shape": shape, "audio_seconds": seconds, "tokens": len(timings["ours"].output),
                         "same_tokens": timings["ours"].output == timings["transformers"].output,
                         "ours": timings["ours"].seconds, "transformers": timings["transformers"].seconds,
                         "warm_ups": {name: timing.warm_ups for name, timing in timings.items()}})
        reference.close()
        print(f"{shape}: done", file=sys.stderr)
    return {"repeats": args.repeats, "window_tokens": WINDOW_TOKENS, "reference": reference.version, "rows": rows}


def render_whisper(data: dict) -> str:
    def factor(row, name):  # the real-time factor: seconds of work per second of audio, the median run's
        return statistics.median(row[name]) / row["audio_seconds"]

    rows = [[row["shape"], f"{row['audio_seconds'] // 60} min" if row["audio_seconds"] >= 60 else f"{row['audio_seconds']} s",
             f"{row['tokens']:,}", f"{factor(row, 'ours'):.3f}", f"{factor(row, 'transformers'):.3f}",
             f"{factor(row, 'transformers') / factor(row, 'ours'):.2f}x", "yes" if row["same_tokens"] else "**no**"]
            for row in data["rows"]]
    return (f"Transcribing espeak-ng's speech, greedy, random weights with Whisper's vocabulary and rules, at most "
            f"{data['window_tokens']} tokens a window, float32: the real-time factor (seconds of work per second of "
            f"audio, from the file to its tokens; lower is faster), medians of {data['repeats']} alternating runs "
            f"against {data['reference']}\n\n"
            + table(["shape", "audio", "tokens", "ours", "transformers", "ours faster by", "same tokens"], rows)
            + warm_up_note({f"{name} ({row['shape']}, {row['audio_seconds']} s)": count for row in data["rows"]
                            for name, count in row["warm_ups"].items()}))
