"""Speech to text with Whisper: its decoder's openings, the tokens it suppresses, the spoken language, and `transcribe`.

    transcriptions = transcribe(models, ["talk.mp3", "call.wav"], language="en", max_tokens=200)

`Whisper` reads a converted model's generation_config.json (as
transformers' Whisper `generate` reads it): the start of transcript, the
language and task tokens, the no-timestamps token, the tokens suppressed
everywhere and those suppressed first. A file's features (audio.py) are the
request's source; its decoder opens with the start of transcript, its
language, its task and no-timestamps, and its rules suppress what the
config suppresses. Where no language is given, a multilingual model's is
detected from the file's first 30 s, on the encoder output its decoding then
reuses. Files decode together, in one batch, drafted or not as the settings
say (the draft follows the same rules).
"""

import json
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import audio
import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx
import numpy as np

from batches import batch_for
from errors import OptionError
from options import Opening, Settings, Stats
from plans import with_presets
from rows import Request
from rules import BadWords, Rule, Timestamps

TASKS = ("transcribe", "translate")
TIMESTAMP_SECONDS = 0.02  # a timestamp token's step
FRAMES_PER_STEP = 2  # feature frames (10 ms) a timestamp step spans: the encoder's stride


@dataclass(frozen=True)
class AtStart(Rule):
    """transformers' SuppressTokensAtBeginLogitsProcessor: tokens banned as a
    row's first output token only (Whisper's space and end of text), on the
    device with the other fixed bans."""

    tokens: tuple[int, ...]

    first_only = True

    def banned(self, before: Sequence[int]) -> tuple[int, ...]:
        return self.tokens


@dataclass(frozen=True)
class Whisper:
    """A Whisper model's special tokens and suppressions, from its generation config."""

    start: int  # <|startoftranscript|>
    end: int  # <|endoftext|>
    languages: dict = field(default_factory=dict)  # "<|en|>" -> id; empty for an English-only model
    tasks: dict = field(default_factory=dict)  # "transcribe" -> id
    no_timestamps: int | None = None  # and the timestamps after it, <|0.00|> to <|30.00|>
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    vocabulary: int = 0
    max_initial: int | None = None  # the latest first timestamp, in steps of 0.02 s
    previous: int | None = None  # <|startofprev|>, which a prompt opens with
    positions: int = 448  # the decoder's

    @classmethod
    def of(cls, models) -> "Whisper":
        args, generation = models.target.args, models.generation
        if not args.num_mel_bins:
            raise OptionError("this model reads text, not audio: pass a Whisper model for --audio")
        multilingual = generation.get("is_multilingual", bool(generation.get("lang_to_id")))
        return cls(start=generation.get("decoder_start_token_id", args.decoder_start_token_id),
                   end=args.eos_token_id, languages=(generation.get("lang_to_id") or {}) if multilingual else {},
                   tasks=generation.get("task_to_id") or {}, no_timestamps=generation.get("no_timestamps_token_id"),
                   suppress=tuple(generation.get("suppress_tokens") or ()),
                   begin_suppress=tuple(generation.get("begin_suppress_tokens") or ()), vocabulary=args.vocab_size,
                   max_initial=generation.get("max_initial_timestamp_index"),
                   previous=generation.get("prev_sot_token_id"), positions=args.max_positions)

    @property
    def first_timestamp(self) -> int | None:
        return None if self.no_timestamps is None else self.no_timestamps + 1

    @property
    def multilingual(self) -> bool:
        return bool(self.languages)  # (Whisper.of reads the config's is_multilingual into languages)

    def language_token(self, language: str) -> int:
        """"en", "<|en|>" or a name transformers takes ("english") -> its token; OptionError naming the codes."""
        code = LANGUAGE_NAMES.get(language.lower(), language.lower()).strip("<|>")
        token = self.languages.get(f"<|{code}|>")
        if token is None:
            codes = ", ".join(sorted(code.strip("<|>") for code in self.languages))
            raise OptionError(f"unknown language {language!r} (this model's: {codes})" if self.languages else
                              "this model is English-only: it takes no language")
        return token

    def opening(self, language: int | None, task: str, timestamps: bool = False, prefix: tuple[int, ...] = ()) -> Opening:
        """The prompt's prefix (Whisper.prompt), the start of transcript, the
        language and the task (a multilingual model's), then no-timestamps
        unless they are asked for: transformers' decoder prompt."""
        start = [*prefix, self.start]
        if self.multilingual:
            start += [language, self.tasks[task]]
        if self.no_timestamps is not None and not timestamps:
            start.append(self.no_timestamps)
        return Opening(tuple(start))

    def rules(self, opening: Opening, timestamps: bool = False) -> tuple:
        """The rules of a row that opens so: the tokens suppressed, those
        suppressed first, and the timestamps' (when asked for), whose check
        of the logits comes after every ban, as transformers orders them."""
        rules = []
        if self.suppress:
            rules.append(BadWords(tuple((token,) for token in self.suppress)))
        if self.begin_suppress:
            rules.append(AtStart(self.begin_suppress))
        if timestamps:
            rules.append(Timestamps(self.first_timestamp, self.no_timestamps, self.end, len(opening.start),
                                    self.vocabulary, self.max_initial))
        return tuple(rules)

    def window_segments(self, tokens: list[int], offset: float, frames: int) -> tuple[list[dict], int]:
        """A window's output (its end of text left out) in segments ({start,
        end, tokens}, in seconds from `offset`, the window's start), and the
        frames the file moves on by, as transformers' long-form decoding
        splits them: a pair of timestamps closes a segment and opens the
        next; text after the last pair is dropped and the next window starts
        at that pair (a window ending in a lone timestamp, or with no pair,
        is used whole). Without a pair, one segment of the whole, to its last
        timestamp or the window's end."""
        first = self.first_timestamp if self.first_timestamp is not None else self.vocabulary + 1
        stamp = [token >= first for token in tokens]
        lone_ending = stamp[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
        if not cuts:
            stamps = [token for token in tokens if token >= first]
            # (in transformers' floats: 58 frames are 28 steps there, not 29)
            last = float(stamps[-1] - first) if stamps and stamps[-1] != first else int(frames * 0.01 / TIMESTAMP_SECONDS)
            return [{"start": offset, "end": offset + last * TIMESTAMP_SECONDS, "tokens": tokens}], frames
        if lone_ending:
            cuts.append(len(tokens))
        else:
            cuts[-1] += 1  # the last pair's second timestamp stays with its segment
        segments, begin = [], 0
        for n, cut in enumerate(cuts):
            piece = tokens[begin:cut]
            closing = piece[-2] if n == len(cuts) - 1 and not lone_ending else piece[-1]
            segments.append({"start": offset + (piece[0] - first) * TIMESTAMP_SECONDS,
                             "end": offset + (closing - first) * TIMESTAMP_SECONDS, "tokens": piece})
            begin = cut
        # The next window starts at the last pair (a window that would not move on is used whole).
        advance = frames if lone_ending else (tokens[begin - 2] - first) * FRAMES_PER_STEP
        return segments, advance if advance > 0 else frames

    def prompt(self, tokenizer, text: str | None) -> tuple[int, ...]:
        """<|startofprev|> and a prompt's tokens (its last 223, as openai-whisper keeps them), which every window's
        opening starts with, as transformers' prompt_ids; () for no prompt."""
        if not text:
            return ()
        if self.previous is None:
            raise OptionError("this model's generation config has no prev_sot_token_id: it takes no prompt", "prompt")
        ids = tokenizer.encode(" " + text.strip(), add_special_tokens=False)
        return (self.previous, *ids[-(self.positions // 2 - 1):])

    def after_start(self, target, cache, prefixes: list[tuple[int, ...]]) -> mx.array:
        """(rows, V): the target's logits after each row's prefix and the start
        of transcript (padded on the right where they differ); the cache left
        as it was."""
        rows = [[*prefix, self.start] for prefix in prefixes]
        width = max(len(row) for row in rows)
        logits = target.decode(mx.array([row + [self.start] * (width - len(row)) for row in rows]), cache)
        cache.trim(width)
        return logits[mx.arange(len(rows)), mx.array([len(row) - 1 for row in rows])]

    def detect(self, logits: mx.array) -> list[int]:
        """Each row's likeliest language token in its logits after the start of
        transcript alone, as transformers' detect_language decides it."""
        ids = mx.array(sorted(self.languages.values()))
        return [int(token) for token in ids[mx.argmax(logits[:, ids], axis=-1)].tolist()]

    def no_speech_probs(self, logits: mx.array) -> list[float]:
        """Each row's probability of <|nospeech|> (the token before <|notimestamps|>) in its logits after the start
        of transcript, before any rule, as transformers' WhisperNoSpeechDetection reads it."""
        if self.no_timestamps is None:
            return [0.0] * logits.shape[0]
        return mx.softmax(logits.astype(mx.float32), axis=-1)[:, self.no_timestamps - 1].tolist()


@dataclass(frozen=True)
class Guards:
    """When a window is decoded again, hotter, or passed over as silence, as
    transformers' and openai-whisper's long-form decoding decide it. With
    none set (the default, as in transformers) every window is decoded once,
    at the settings' temperature."""

    temperatures: tuple[float, ...] = ()  # tried in turn while a threshold fails; () : the settings' temperature
    compression_ratio_threshold: float | None = None  # above it the window is too repetitive
    logprob_threshold: float | None = None  # below it the window is too unsure
    no_speech_threshold: float | None = None  # above it (and unsure, when logprob_threshold is set): silence

    @classmethod
    def of(cls, temperature: float, step: float | None, compression_ratio_threshold: float | None = None,
           logprob_threshold: float | None = None, no_speech_threshold: float | None = None) -> "Guards":
        """openai-whisper's options: with a step (its temperature_increment_on_fallback), the temperatures from
        `temperature` up to 1 by it."""
        if step is not None and not 0 < step <= 1:
            raise OptionError(f"the temperature's increment on fallback is a step in (0, 1], not {step}",
                              "temperature_increment_on_fallback")
        temperatures = () if step is None else tuple(float(t) for t in np.arange(temperature, 1 + 1e-6, step))
        return cls(temperatures, compression_ratio_threshold, logprob_threshold, no_speech_threshold)

    def retry(self, window: "Window") -> bool:
        """The window fails a threshold (and is not silence): decode it again at the next temperature."""
        ratio, unsure = self.compression_ratio_threshold, self.logprob_threshold
        failed = (ratio is not None and window.compression_ratio > ratio) or \
                 (unsure is not None and window.avg_logprob < unsure)
        return failed and not self.silent(window)

    def silent(self, window: "Window") -> bool:
        """The window is silence, by the no-speech probability after its start
        of transcript (and its average log-probability, when that has a
        threshold too): it is skipped."""
        if self.no_speech_threshold is None or window.no_speech_prob <= self.no_speech_threshold:
            return False
        return self.logprob_threshold is None or window.avg_logprob < self.logprob_threshold

    @property
    def any(self) -> bool:
        return any(value is not None for value in (self.compression_ratio_threshold, self.logprob_threshold,
                                                   self.no_speech_threshold))


@dataclass(eq=False)
class Window:
    """One decoding of 30 s of a file, from `seek` (in 10 ms frames): its
    request, and what the guards read of it."""

    request: Request
    seek: int
    frames: int  # the file's frames it holds, up to 3,000 (the rest is padding)
    temperature: float
    no_speech_prob: float = 0.0  # the probability of <|nospeech|> after its start of transcript
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    avg_logprob: float | None = None  # what the guards read, once it ends (Window.close)
    compression_ratio: float | None = None

    def close(self, vocabulary: int, end: int) -> None:
        """Its figures, as transformers computes them: the mean log-probability
        of its tokens, the end of text's included (after the rules, at
        temperature 1); its tokens' bytes (the end of text's included) over
        their zlib-compressed bytes."""
        request, ended = self.request, self.request.end_logprob is not None
        picked = [logprob for logprob, _ in request.logprobs] + [request.end_logprob] * ended
        self.avg_logprob = sum(picked) / len(picked) if picked else 0.0
        width = int(math.log2(vocabulary) / 8) + 1
        data = b"".join(token.to_bytes(width, "little") for token in self.tokens + [end] * ended)
        self.compression_ratio = len(data) / len(zlib.compress(data))


@dataclass(eq=False)
class Track:
    """One file's way through the sequential algorithm: where it stands, and its segments so far."""

    listening: "Listening" = field(repr=False)
    features: np.ndarray  # (frames, bins): the whole file's
    frames: int  # its frames to decode (a file of up to 30 s: the whole window, padding included)
    duration: float
    timestamps: bool  # decoded with timestamps (over 30 s: always, as the windows move by them)
    language: int | None = None  # its language token (a multilingual model's)
    seek: int = 0
    attempt: int = 0  # the temperature tried now (Guards.temperatures)
    window: Window | None = None
    segments: list[dict] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish: str | None = None
    sent: int = 0  # segments already given out

    @property
    def done(self) -> bool:
        return self.seek >= self.frames

    def window_features(self) -> mx.array:
        """The 3,000 frames from seek, the file's last window padded with zeros, as transformers pads it."""
        part = self.features[self.seek : self.seek + audio.WINDOW_FRAMES]
        return mx.array(np.pad(part, [(0, audio.WINDOW_FRAMES - len(part)), (0, 0)]))


@dataclass
class Transcription:
    """A file's text and the tokens that made it (its segments', timestamps included), its language and length,
    its segments, and its statistics (its windows' together)."""

    text: str
    tokens: list[int]
    language: str | None
    duration: float  # seconds of audio
    finish_reason: str | None  # its last window's
    stats: Stats
    segments: list[dict] = field(default_factory=list)  # Whisper.segments' fields, and the window's figures
    task: str = "transcribe"


def transcribe(models, files: list, *, language: str | None = None, task: str = "transcribe", timestamps: bool = False,
               guards: Guards = Guards(), prompt: str | None = None, settings: Settings | None = None, given=(),
               **options) -> list[Transcription]:
    """Each file's Transcription (a path, a file's bytes, or its samples as
    audio.read gives them), decoded together in one batch at these settings
    (options as Settings' fields, over the model's generation defaults). A
    file over 30 s is decoded window by window, each moving on from the last
    one's last timestamp, as transformers' long-form generate does; with
    `timestamps`, a short file too. `max_tokens` counts a window's tokens."""
    listening = Listening.of(models, language, task, timestamps, guards, prompt, settings, given, options)
    tracks = [listening.track(file) for file in files]
    for _ in listen(tracks):
        pass
    return [listening.transcription(track) for track in tracks]


def stream_transcribe(models, file, *, language: str | None = None, task: str = "transcribe", timestamps: bool = True,
                      guards: Guards = Guards(), prompt: str | None = None, settings: Settings | None = None, given=(),
                      **options) -> Iterator[dict]:
    """One file's segments as they are decided: with no guard set, each as
    soon as the timestamps after it show it final (its window's figures,
    avg_logprob and compression_ratio, None until the window ends); with
    guards, a window's once it ends and passes them."""
    listening = Listening.of(models, language, task, timestamps, guards, prompt, settings, given, options)
    for _, segment in listen([listening.track(file)]):
        yield segment


def warm_up(models, settings: Settings) -> None:
    """A second of silence transcribed on each decoding path the settings can
    take (the target alone, and drafting if they draft), so that first-call
    costs (compiling kernels, growing the allocator's pools) stay out of the
    first request's time."""
    silence = np.zeros(audio.SAMPLE_RATE, np.float32)
    paths = (False, True) if replace(settings, speculative=True).drafts(models) else (False,)
    for speculative in paths:
        transcribe(models, [silence], settings=replace(settings, speculative=speculative), max_tokens=4)


def listen(tracks: list[Track]) -> Iterator[tuple[Track, dict]]:
    """Files decoded window by window in one batch, each segment yielded as
    it is decided: a file's next window joins as soon as its last ends, so
    that no file waits for another's."""
    if not tracks:
        return
    first = tracks[0].listening
    batch = batch_for(first.models, first.settings, len(tracks))
    joining, owners = [track for track in tracks if not track.done], {}  # id(a window's request) -> its track
    while joining or batch.rows:
        if joining:
            requests = [track.listening.window(track) for track in joining]
            owners.update({id(request): track for request, track in zip(requests, joining)})
            encoding = batch.encoding(requests)
            open_windows(first.models, encoding.finish()[0], joining)
            batch.join(requests, encoding)
        joining = []
        for request, token, reason in batch.round():
            track = owners[id(request)]
            for segment in track.listening.token(track, token):
                yield track, segment
            if reason:
                for segment in track.listening.ended(track, reason):
                    yield track, segment
                del owners[id(request)]
                if not track.done:
                    joining.append(track)


def open_windows(models, cache, tracks: list[Track]) -> None:
    """Before their windows join a batch, encoded together into `cache`
    (row i track i's): each track's language, detected from its first window
    where none was given; each window's no-speech probability, read after its
    start of transcript; and its opening, rules and most tokens."""
    whisper, target = tracks[0].listening.whisper, models.target
    prefixes = [track.listening.prefix for track in tracks]
    logits = whisper.after_start(target, cache, prefixes)
    if whisper.multilingual and any(track.language is None for track in tracks):
        # on the start of transcript alone (every row: cheaper than picking some)
        alone = whisper.after_start(target, cache, [()] * len(tracks)) if any(prefixes) else logits
        for track, token in zip(tracks, whisper.detect(alone)):
            track.language = track.language or token
    for track, probability in zip(tracks, whisper.no_speech_probs(logits)):
        track.window.no_speech_prob = probability
        track.listening.opened(track)


@dataclass
class Listening:
    """One call's way of listening (its language, task, guards, prompt and
    settings), and what it does with each file's `Track` window by window:
    each window's request, its tokens, its end."""

    whisper: Whisper
    models: object = field(repr=False)
    settings: Settings
    language: int | None  # the language token given (a multilingual model's); None: detected
    task: str
    timestamps: bool
    guards: Guards
    prefix: tuple[int, ...]  # <|startofprev|> and a prompt's tokens, before the start of transcript
    max_tokens: int | None  # as asked; None: what each window's opening leaves

    @classmethod
    def of(cls, models, language: str | None, task: str, timestamps: bool, guards: Guards, prompt: str | None,
           settings: Settings | None, given, options: dict) -> "Listening":
        whisper = Whisper.of(models)
        if task not in TASKS:
            raise OptionError(f"task must be transcribe or translate, not {task!r}", "task")
        if task == "translate" and not whisper.multilingual:
            raise OptionError("this model is English-only: it transcribes, and does not translate", "task")
        fixed = whisper.language_token(language) if language is not None and whisper.multilingual else None
        if language is not None and not whisper.multilingual:
            whisper.language_token(language)  # English-only: refuses any language
        settings = replace(settings or Settings(), **options)
        given = set(given) | set(options)
        _, settings, _ = with_presets(models, settings, given=given, search=False)
        if settings.num_beams > 1 or settings.n > 1:
            raise OptionError("beam search and n are not for audio yet: decode greedily, or sample", "num_beams")
        prefix = whisper.prompt(models.tokenizer, prompt)
        # The decoder's positions hold the opening and the output: by default a window's output takes what its
        # opening leaves (transformers' max_length of 448 does the same); asked for more, it is refused.
        positions = models.target.args.max_positions
        opened = len(whisper.opening(next(iter(whisper.languages.values()), None), task, timestamps, prefix).start)
        if "max_tokens" in given and settings.max_tokens + opened > positions:
            raise OptionError(f"max_tokens is {settings.max_tokens:,}: with the {opened} tokens the decoder opens "
                              f"with, this model's {positions} positions leave {positions - opened} for the output",
                              "max_tokens")
        if not guards.temperatures:
            guards = replace(guards, temperatures=(settings.temp,))
        # each token's log-probability, for the guards and the segments' figures
        settings = replace(settings, logprobs=0).check_models(models)
        return cls(whisper, models, settings, fixed, task, timestamps, guards, prefix,
                   settings.max_tokens if "max_tokens" in given else None)

    def track(self, file) -> Track:
        """A file (a path, its bytes, or its samples) read, and its features
        made: a file of up to 30 s padded to the window, as transformers pads
        it; a longer one at its whole length, decoded with timestamps (the
        windows move by them)."""
        samples = file if isinstance(file, np.ndarray) else audio.read(file)
        long = len(samples) > audio.WINDOW_SAMPLES
        frames = len(samples) // audio.HOP if long else audio.WINDOW_FRAMES
        features = audio.log_mel(samples, self.models.target.args.num_mel_bins, frames)
        return Track(self, features, frames, len(samples) / audio.SAMPLE_RATE, self.timestamps or long, self.language)

    def window(self, track: Track) -> Request:
        """The request of the track's next window (its opening set once it is encoded: open_windows)."""
        temperature = self.guards.temperatures[track.attempt]
        request = Request(track.window_features(), replace(self.settings, temp=temperature), ruled_logprobs=True)
        track.window = Window(request, track.seek, min(track.frames - track.seek, audio.WINDOW_FRAMES), temperature)
        return request

    def opened(self, track: Track) -> None:
        """The window's opening (its language known), its rules and its most tokens."""
        request = track.window.request
        request.opening = self.whisper.opening(track.language, self.task, track.timestamps, self.prefix)
        request.rules = self.whisper.rules(request.opening, track.timestamps)
        most = self.models.target.args.max_positions - len(request.opening.start)
        request.settings = replace(request.settings, max_tokens=self.max_tokens or most)

    def token(self, track: Track, token: int | None) -> list[dict]:
        """A token of the track's window: the segments it shows final (with
        no guard set, each once the pair of timestamps after the next is out:
        a window's last pair is part of its segment, an earlier one is not)."""
        if token is None:
            return []
        tokens, first = track.window.tokens, self.whisper.first_timestamp
        tokens.append(token)
        if self.guards.any or first is None or len(tokens) < 2 or tokens[-1] < first or tokens[-2] < first:
            return []
        final = self.whisper.window_segments(tokens, self.offset(track.window), track.window.frames)[0][:-1]
        new = [self.finished(segment, track.window) for segment in final[track.sent :]]
        track.sent = max(track.sent, len(final))
        return new

    def ended(self, track: Track, finish: str) -> list[dict]:
        """The track's window is done: the segments it decided that were not
        given out yet, and the file moves on (or the window is decoded again
        hotter, or passed over as silence)."""
        window = track.window
        window.finish = finish
        window.close(self.whisper.vocabulary, self.whisper.end)
        track.stats = track.stats + window.request.stats
        if self.guards.retry(window) and track.attempt + 1 < len(self.guards.temperatures):
            track.attempt += 1  # (the seek stays: the same window again)
            return []
        track.attempt, track.window, track.finish = 0, None, window.finish
        if self.guards.silent(window):
            track.seek += window.frames
            return []
        segments, advance = self.whisper.window_segments(window.tokens, self.offset(window), window.frames)
        segments = [self.finished(segment, window) for segment in segments]
        track.segments += segments
        track.seek += advance
        new, track.sent = segments[track.sent :], 0
        return new

    @staticmethod
    def offset(window: Window) -> float:
        """Where a window starts, in seconds (as transformers computes it: in float64, from frames)."""
        return window.seek * TIMESTAMP_SECONDS / FRAMES_PER_STEP

    def finished(self, segment: dict, window: Window) -> dict:
        """A segment as the transcription gives it: OpenAI's verbose_json fields (the window's figures None until it
        ends)."""
        text = [token for token in segment["tokens"] if token < self.whisper.end]
        return {"seek": window.seek, "start": round(segment["start"], 2), "end": round(segment["end"], 2),
                "text": self.text(text), "tokens": segment["tokens"], "temperature": window.temperature,
                "avg_logprob": window.avg_logprob, "compression_ratio": window.compression_ratio,
                "no_speech_prob": window.no_speech_prob}

    def text(self, ids: list[int]) -> str:
        return self.models.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def transcription(self, track: Track) -> Transcription:
        names = {token: code.strip("<|>") for code, token in self.whisper.languages.items()}
        language = names.get(track.language, None if self.whisper.multilingual else "en")
        tokens = [token for segment in track.segments for token in segment["tokens"]]
        return Transcription(self.text([token for token in tokens if token < self.whisper.end]), tokens, language,
                             track.duration, track.finish, track.stats, track.segments, self.task)


# The language names transformers' generate takes, for the codes of Whisper's first 99 languages.
LANGUAGE_NAMES = {
    "english": "en", "chinese": "zh", "german": "de", "spanish": "es", "russian": "ru", "korean": "ko",
    "french": "fr", "japanese": "ja", "portuguese": "pt", "turkish": "tr", "polish": "pl", "catalan": "ca",
    "dutch": "nl", "arabic": "ar", "swedish": "sv", "italian": "it", "indonesian": "id", "hindi": "hi",
    "finnish": "fi", "vietnamese": "vi", "hebrew": "he", "ukrainian": "uk", "greek": "el", "malay": "ms",
    "czech": "cs", "romanian": "ro", "danish": "da", "hungarian": "hu", "tamil": "ta", "norwegian": "no",
    "thai": "th", "urdu": "ur", "croatian": "hr", "bulgarian": "bg", "lithuanian": "lt", "latin": "la",
    "maori": "mi", "malayalam": "ml", "welsh": "cy", "slovak": "sk", "telugu": "te", "persian": "fa",
    "latvian": "lv", "bengali": "bn", "serbian": "sr", "azerbaijani": "az", "slovenian": "sl", "kannada": "kn",
    "estonian": "et", "macedonian": "mk", "breton": "br", "basque": "eu", "icelandic": "is", "armenian": "hy",
    "nepali": "ne", "mongolian": "mn", "bosnian": "bs", "kazakh": "kk", "albanian": "sq", "swahili": "sw",
    "galician": "gl", "marathi": "mr", "punjabi": "pa", "sinhala": "si", "khmer": "km", "shona": "sn",
    "yoruba": "yo", "somali": "so", "afrikaans": "af", "occitan": "oc", "georgian": "ka", "belarusian": "be",
    "tajik": "tg", "sindhi": "sd", "gujarati": "gu", "amharic": "am", "yiddish": "yi", "lao": "lo",
    "uzbek": "uz", "faroese": "fo", "haitian creole": "ht", "pashto": "ps", "turkmen": "tk", "nynorsk": "nn",
    "maltese": "mt", "sanskrit": "sa", "luxembourgish": "lb", "myanmar": "my", "tibetan": "bo", "tagalog": "tl",
    "malagasy": "mg", "assamese": "as", "tatar": "tt", "hawaiian": "haw", "lingala": "ln", "hausa": "ha",
    "bashkir": "ba", "javanese": "jw", "sundanese": "su", "cantonese": "yue",
}


FORMATS = ("json", "text", "srt", "verbose_json", "vtt")  # OpenAI's response_format


def render(transcription: Transcription, form: str) -> str:
    """A transcription as OpenAI's audio endpoints answer in each response_format: json ({"text"}), text, srt,
    verbose_json (text, language, duration, segments) or vtt."""
    if form == "text":
        return transcription.text + "\n"
    if form == "json":
        return json.dumps({"text": transcription.text})
    if form == "verbose_json":
        return json.dumps({"task": transcription.task, "language": transcription.language,
                           "duration": round(transcription.duration, 3), "text": transcription.text,
                           "segments": [{"id": i} | segment for i, segment in enumerate(transcription.segments)]})
    if form not in ("srt", "vtt"):
        raise OptionError(f"the format is one of {', '.join(FORMATS)}, not {form!r}", "response_format")
    mark = "," if form == "srt" else "."
    cues = []
    for i, segment in enumerate(transcription.segments, 1):
        span = f"{clock(segment['start'], mark)} --> {clock(segment['end'], mark)}"
        cues.append(f"{i}\n{span}\n{segment['text'].strip()}\n" if form == "srt" else f"{span}\n{segment['text'].strip()}\n")
    return ("" if form == "srt" else "WEBVTT\n\n") + "\n".join(cues)


def clock(seconds: float, mark: str) -> str:
    """HH:MM:SS,mmm (SubRip's) or HH:MM:SS.mmm (WebVTT's)."""
    milliseconds = round(seconds * 1000)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    return f"{hours:02d}:{minutes:02d}:{milliseconds // 1000:02d}{mark}{milliseconds % 1000:03d}"
