"""whisper-profile: where a 30 s window's time goes on real Whisper (tiny.en, base), ours beside transformers' and
mlx-whisper's, split the same way where they can be: reading the file, the log-mel features, the encoder (its
convolution stem apart, for ours), the cross-attention keys and values, and each decoded token: a decoder step
(its layers, read back) less the vocabulary head, the head, and what remains of a token's time (rules, the
engine's bookkeeping, detokenizing, segments). Each part is timed alone, warm, the median of --repeats; a contender's whole
transcription too, and its decoding per token is that whole less the parts before the first token."""

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

from bench.harness import Worker, alternate, table
from bench.speech import mlx_whisper_options, read_wav

TOKENS = 224  # at most, a window (bench whisper's REAL_WINDOW_TOKENS)
HEAD_STEPS = 50  # vocabulary head products timed in a row


def median_seconds(run, repeats: int) -> float:
    """run() warmed until its time is steady, then the median of `repeats` timed runs (the harness's alternate)."""
    def timed():
        start = time.perf_counter()
        run()
        return time.perf_counter() - start, None

    return alternate({"part": timed}, repeats)["part"].median


def profile_ours(mlx: Path, path: Path, repeats: int) -> dict:
    """Our parts, timed alone on this process's path as speech.transcribe runs them (one row). The steps build their
    cache's cross-attention keys and values first, as a transcription does: the render takes them out."""
    import audio
    import mlx.core as mx
    import speech
    from loading import load

    models = load(str(mlx), one_row=True)
    model = models.target
    language = "en" if models.generation.get("is_multilingual") else None
    (heard,) = speech.transcribe(models, [path], language=language, max_tokens=TOKENS)
    samples = audio.read(path)
    features = mx.array(audio.log_mel(samples, model.args.num_mel_bins))[None]
    encoded = model.encode(features)
    mx.eval(encoded)
    whisper = speech.Whisper.of(models)
    opening = list(whisper.opening(whisper.languages.get(f"<|{language}|>"), "transcribe").start)
    fed = opening + heard.tokens

    def steps():
        cache = model.make_cache(encoded)
        model.decode(mx.array([opening]), cache)
        for token in fed[len(opening):]:
            int(model.decode(mx.array([[token]]), cache)[0, -1].argmax().item())  # read back, as a greedy step does

    hidden = mx.random.normal((1, 1, model.args.d_model))
    mx.eval(hidden)

    def head():
        for _ in range(HEAD_STEPS):
            mx.eval(model.shared.as_linear(hidden) if model.args.tie_word_embeddings else model.lm_head(hidden))

    parts = {
        "read": median_seconds(lambda: audio.read(path), repeats),
        "features": median_seconds(lambda: audio.log_mel(samples, model.args.num_mel_bins), repeats),
        "stem": median_seconds(lambda: mx.eval(model.source_input(features)), repeats),
        "encoder": median_seconds(lambda: mx.eval(model.encode(features)), repeats),
        "cross": median_seconds(lambda: mx.eval(model.make_cache(encoded).cross_keys_values), repeats),
        "steps": median_seconds(steps, repeats),
        "head": median_seconds(head, repeats) / HEAD_STEPS,
        "whole": median_seconds(lambda: speech.transcribe(models, [path], language=language, max_tokens=TOKENS),
                                repeats),
    }
    return {"tokens": len(heard.tokens), "opening": len(opening), **parts}


def profile_worker(folder: str, reference: str) -> None:
    """Persistent reference process: one profile per input line (JSON: a 16 kHz WAV file, the repeats)."""
    profile = {"transformers": transformers_profile, "mlx-whisper": mlx_whisper_profile}[reference]
    print(json.dumps({"ready": VERSIONS[reference]()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(profile(Path(folder), Path(request["file"]), request["repeats"])), flush=True)


VERSIONS = {"transformers": lambda: f"transformers {version('transformers')}, PyTorch {version('torch')}",
            "mlx-whisper": lambda: f"mlx-whisper {version('mlx-whisper')}"}


def transformers_profile(folder: Path, path: Path, repeats: int) -> dict:
    """transformers' parts: the feature extractor, the encoder's forward, the head alone, and generate whole (as a
    user calls it, short-form)."""
    import os

    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    model = WhisperForConditionalGeneration.from_pretrained(folder).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    english = dict(language="en", task="transcribe") if model.generation_config.is_multilingual else {}

    samples = read_wav(path)
    features = extractor(samples, sampling_rate=16_000, return_tensors="pt").input_features
    hidden = torch.randn(1, 1, model.config.d_model)

    def head():
        for _ in range(HEAD_STEPS):
            model.proj_out(hidden)

    with torch.no_grad():
        out = model.generate(features, max_new_tokens=TOKENS, **english)
        return {"tokens": int((out[0] < model.generation_config.eos_token_id).sum()),
                "read": median_seconds(lambda: read_wav(path), repeats),
                "features": median_seconds(lambda: extractor(samples, sampling_rate=16_000, return_tensors="pt"), repeats),
                "encoder": median_seconds(lambda: model.model.encoder(features), repeats),
                "head": median_seconds(head, repeats) / HEAD_STEPS,
                "whole": median_seconds(lambda: model.generate(extractor(read_wav(path), sampling_rate=16_000,
                                                                         return_tensors="pt").input_features,
                                                               max_new_tokens=TOKENS, **english), repeats)}


def mlx_whisper_profile(folder: Path, path: Path, repeats: int) -> dict:
    """mlx-whisper's parts on the same MLX and BLAS (cpu.py first): its log-mel, its encoder, the head alone, and
    transcribe whole (given the samples, read as transformers' worker reads them)."""
    import cpu  # noqa: F401  (before mlx.core)
    import mlx.core as mx
    import mlx_whisper
    from mlx_whisper.audio import N_SAMPLES, log_mel_spectrogram, pad_or_trim
    from mlx_whisper.load_models import load_model

    model = load_model(str(folder), dtype=mx.float32)
    options = mlx_whisper_options(folder, False, TOKENS)

    samples = read_wav(path)

    def features():
        return log_mel_spectrogram(samples, n_mels=model.dims.n_mels, padding=N_SAMPLES)

    mel = pad_or_trim(features(), 3000, axis=-2)[None]
    hidden = mx.random.normal((1, 1, model.dims.n_text_state))
    mx.eval(mel, hidden)

    def head():
        for _ in range(HEAD_STEPS):
            mx.eval(model.decoder.token_embedding.as_linear(hidden))

    result = mlx_whisper.transcribe(samples, **options)
    return {"tokens": sum(len(segment["tokens"]) for segment in result["segments"]),
            "read": median_seconds(lambda: read_wav(path), repeats),
            "features": median_seconds(lambda: mx.eval(features()), repeats),
            "encoder": median_seconds(lambda: mx.eval(model.encoder(mel)), repeats),
            "head": median_seconds(head, repeats) / HEAD_STEPS,
            "whole": median_seconds(lambda: mlx_whisper.transcribe(read_wav(path), **options), repeats)}


def run_whisper_profile(args) -> dict:
    import real_whisper
    from bench.speech import real_checkpoint, reference_folder, sentences

    rows, versions = [], {}
    path, _ = sentences(args.dir / "whisper-sentences", (30,))[30]
    for name in args.shapes.split(",") if args.shapes else list(real_whisper.MODELS):
        hf, mlx = real_checkpoint(args.dir, name)
        parts = {"ours": profile_ours(mlx, path, args.repeats)}
        for reference in ("transformers", "mlx-whisper"):
            folder = reference_folder(hf, reference)
            if folder is None:
                continue
            worker = Worker("--whisper-profile-worker", str(folder), "--whisper-reference", reference)
            try:
                versions[reference] = worker.version
                parts[reference] = worker.ask({"file": str(path), "repeats": args.repeats})
            finally:
                worker.close()
            print(f"{name}, {reference}: done", file=sys.stderr)
        rows.append({"model": name, "parts": parts})
    return {"repeats": args.repeats, "window_tokens": TOKENS, "versions": versions, "rows": rows}


def before_tokens(parts: dict) -> float:
    return parts.get("read", 0) + parts["features"] + parts["encoder"] + parts.get("cross", 0)


def render_whisper_profile(data: dict) -> str:
    def ms(seconds):
        return f"{seconds * 1000:,.1f}" if seconds is not None else "-"

    lines = []
    for row in data["rows"]:
        ours = row["parts"]["ours"]
        steps = ours["steps"] - ours["cross"]  # (they built the cross-attention keys and values first)
        step = steps / (ours["tokens"] + 1)  # the opening's pass and each token's
        rest = (ours["whole"] - before_tokens(ours) - steps) / ours["tokens"]
        cells = []
        for name, parts in row["parts"].items():
            per_token = (parts["whole"] - before_tokens(parts)) / max(parts["tokens"], 1)
            mine = name == "ours"
            cells.append([name, parts["tokens"], ms(parts.get("read")), ms(parts["features"]), ms(parts.get("stem")),
                          ms(parts["encoder"] - parts.get("stem", 0)), ms(parts.get("cross")), ms(per_token),
                          ms(step - parts["head"]) if mine else "-", ms(parts["head"]), ms(rest) if mine else "-",
                          ms(parts["whole"])])
        lines.append(f"**{row['model']}**\n\n" + table(
            ["", "tokens", "read", "features", "stem", "encoder", "cross K/V", "a token", "a step less the head", "head",
             "the rest", "whole"], cells))
    versions = "; ".join(data.get("versions", {}).values())
    return (f"A 30 s window of espeak-ng's Zen lines (bench whisper's), greedy, no timestamps, at most "
            f"{data['window_tokens']} tokens, float32; milliseconds, medians of {data['repeats']} warm runs of each "
            "part alone. A token: the whole less the parts before the first token, over the tokens. For ours: a step "
            "(the transcript's tokens fed back one at a time, each argmax read back) less the head: the embedding, the "
            "decoder's layers, the argmax; the head: the vocabulary product alone; the rest: the whole's decoding less "
            "those steps, over the tokens (rules, bookkeeping, text, host work beyond a step's read). The encoder: "
            "ours without its stem, theirs with theirs; their token carries their cross-attention keys and values "
            "(computed in their first step), and transformers' encoder runs again inside generate, so its token "
            f"carries nothing of it.{' References: ' + versions + '.' if versions else ''}\n\n" + "\n\n".join(lines))
