"""Audio in: a file read as 16 kHz mono samples, and Whisper's log-mel features of them.

WAV files of PCM samples at 16 kHz are read with the standard library;
every other file (mp3, m4a, flac, ogg, webm, WAV at another rate) is decoded
and resampled by PyAV, whose wheels bring FFmpeg's libraries
(docs/DECISIONS.md says why). The features are transformers'
`WhisperFeatureExtractor`'s, computed with numpy: a 400-sample Hann window
every 160 samples, the power spectrum through Slaney's mel filters, log10,
floored 8 below the loudest, scaled to about [-1, 1].
"""

import io
import math
import wave
from pathlib import Path

import numpy as np

from errors import T5Error

SAMPLE_RATE = 16_000
WINDOW = 400  # samples: 25 ms
HOP = 160  # samples: 10 ms, a frame
WINDOW_SECONDS = 30  # what every public Whisper's encoder reads at once: 3,000 frames (a model's own: speech.window_frames)
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE
WINDOW_FRAMES = WINDOW_SAMPLES // HOP


class AudioError(T5Error):
    """A file that is not audio this can read: a one-line error (a 400 on the server)."""


def read(source: str | Path | bytes, max_seconds: float | None = None) -> np.ndarray:
    """A file's path, or its bytes, as float32 samples in [-1, 1], mono, 16
    kHz; a file longer than `max_seconds` is refused as soon as that shows
    (its decoding stops there)."""
    data = source if isinstance(source, bytes) else _read_bytes(Path(source))
    most = None if max_seconds is None else int(max_seconds * SAMPLE_RATE)
    try:
        if not data:
            raise AudioError("the audio file is empty")
        samples = _plain_wav(data, most)
        return samples if samples is not None else _decoded(data, most)
    except AudioError as e:
        raise e if isinstance(source, bytes) else AudioError(f"{source}: {e}") from None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise AudioError(f"cannot read {path}: {e.strerror or e}") from None


def too_long(most: int) -> AudioError:
    return AudioError(f"the audio is longer than the {most / SAMPLE_RATE:,.0f} s this accepts")


def _plain_wav(data: bytes, most: int | None = None) -> np.ndarray | None:
    """16 kHz PCM WAV through the standard library; None for anything else."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    try:
        with wave.open(io.BytesIO(data)) as file:
            if file.getframerate() != SAMPLE_RATE or file.getsampwidth() not in (1, 2, 4):
                return None
            width, channels = file.getsampwidth(), file.getnchannels()
            if most is not None and file.getnframes() > most:
                raise too_long(most)
            raw = file.readframes(file.getnframes())
    except (wave.Error, EOFError):
        return None  # a WAV of floats, or extensible: PyAV reads it
    raw = raw[: len(raw) // (width * channels) * width * channels]  # a truncated file: its whole frames
    if not raw:
        raise AudioError("the audio file holds no samples")
    if width == 1:  # unsigned 8-bit
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    else:
        kind = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, kind).astype(np.float32) / float(2 ** (8 * width - 1))
    samples = samples.reshape(-1, channels)
    return samples.mean(axis=1) if channels > 1 else samples[:, 0]


def _decoded(data: bytes, most: int | None = None) -> np.ndarray:
    """Any format FFmpeg reads, through PyAV: its first audio stream, mixed to mono and resampled to 16 kHz."""
    try:
        import av
    except ImportError:
        raise AudioError("this audio is not 16 kHz PCM WAV, and PyAV (pip install av), which reads the rest, "
                         "is not installed") from None
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise AudioError("the file has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            pieces, count = [], 0
            for frame in container.decode(container.streams.audio[0]):
                new = [piece.to_ndarray().reshape(-1) for piece in resampler.resample(frame)]
                pieces += new
                count += sum(len(piece) for piece in new)
                if most is not None and count > most:
                    raise too_long(most)
            pieces += [piece.to_ndarray().reshape(-1) for piece in resampler.resample(None)]  # what it holds back
    except AudioError:
        raise
    except (av.error.FFmpegError, ValueError, EOFError) as e:
        raise AudioError(f"not an audio file this can read ({getattr(e, 'strerror', None) or e})") from None
    if not pieces:
        raise AudioError("the audio stream holds no samples")
    return np.concatenate(pieces).astype(np.float32)


def mel_filters(bins: int) -> np.ndarray:
    """(WINDOW // 2 + 1, bins): triangles evenly spaced on Slaney's mel scale
    from 0 to 8 kHz, each normalised to unit area (librosa's and
    transformers' `norm="slaney"`)."""

    def to_mel(hz):
        hz = np.asarray(hz, np.float64)
        logarithmic = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * (27.0 / np.log(6.4))
        return np.where(hz >= 1000.0, logarithmic, 3.0 * hz / 200.0)

    def to_hz(mel):
        mel = np.asarray(mel, np.float64)
        return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), 200.0 * mel / 3.0)

    edges = to_hz(np.linspace(to_mel(0.0), to_mel(8000.0), bins + 2))
    frequencies = np.linspace(0, SAMPLE_RATE // 2, WINDOW // 2 + 1)
    slopes = edges[None, :] - frequencies[:, None]
    widths = np.diff(edges)
    rising, falling = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    return triangles * (2.0 / (edges[2:] - edges[:-2]))[None, :]


_FILTERS: dict[int, np.ndarray] = {}


CHUNK_FRAMES = 4096  # log_mel's frames a pass: its spectra's memory stays a few tens of MB, however long the file


def log_mel(samples: np.ndarray, bins: int, frames: int | None = None) -> np.ndarray:
    """(frames, bins) float32 features of 16 kHz samples, as transformers'
    WhisperFeatureExtractor makes them: by default the samples padded with
    silence to a whole number of 30 s windows (at least one), each window's
    3,000 frames; `frames` gives another count (the samples padded with silence to it, or
    cut to it, as transformers cuts them; a count the samples hold,
    len // HOP, reads them whole, as long-form does)."""
    if frames is None:
        frames = max(1, math.ceil(len(samples) / WINDOW_SAMPLES)) * WINDOW_FRAMES
    samples = np.asarray(samples, np.float32)
    if len(samples) >= (frames + 1) * HOP:
        samples = samples[: frames * HOP]
    samples = np.pad(samples, (0, max(0, frames * HOP - len(samples))))
    padded = np.pad(samples, WINDOW // 2, mode="reflect")  # centred windows
    if bins not in _FILTERS:
        _FILTERS[bins] = mel_filters(bins)
    hann = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(WINDOW) / WINDOW)).astype(np.float32)  # periodic
    logs = np.empty((frames, bins), np.float32)  # the first `frames` (transformers drops the last, past the samples)
    for first in range(0, frames, CHUNK_FRAMES):
        count = min(CHUNK_FRAMES, frames - first)
        part = padded[first * HOP : first * HOP + (count - 1) * HOP + WINDOW]
        windows = np.lib.stride_tricks.as_strided(part, (count, WINDOW), (part.strides[0] * HOP, part.strides[0]))
        power = np.abs(np.fft.rfft(windows * hann, axis=-1)) ** 2
        logs[first : first + count] = np.log10(np.maximum(power @ _FILTERS[bins], 1e-10))
    logs = np.maximum(logs, logs.max() - 8.0)
    return (logs + 4.0) / 4.0
