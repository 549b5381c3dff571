"""Speech to text with Whisper: `transcribe`, `stream_transcribe`, and the windows a file is decoded in.

    transcriptions = transcribe(models, ["talk.mp3", "call.wav"], language="en")
    for segment in stream_transcribe(models, "lecture.mp3"):
        print(segment["start"], segment["end"], segment["text"])

A file's features (audio.py) are decoded 30 s at a time (a model's window), as transformers' Whisper `generate`
decodes them: each window a request whose decoder opens as speech_tokens.Whisper says (start of transcript,
language, task), with its rules; a window's segments run between its pairs of timestamps, and the next window starts
at its last pair. Where no language is given, a multilingual model's is detected from the file's first window, on
the encoder output its decoding then reuses. Files decode together, in one batch, drafted or not as the settings say
(the draft follows the same rules); `Guards` decide when a window is decoded again or skipped.
"""

import json
from dataclasses import dataclass, field, replace
from typing import Iterator

import audio
import numpy as np

from batches import batch_for
from errors import OptionError
from options import Settings, Stats
from plans import with_presets
from rows import Request
from speech_tokens import FRAMES_PER_STEP, LANGUAGE_NAMES, SPACELESS, TASKS, TIMESTAMP_SECONDS, Whisper, window_frames
from speech_tokens import compression_ratio, token_times, words_of


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
    prefix: tuple[int, ...] = ()  # what its opening starts with (Listening.prefix_of)
    no_speech_prob: float = 0.0  # the probability of <|nospeech|> after its start of transcript
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    avg_logprob: float | None = None  # what the guards read, once it ends (Window.close)
    compression_ratio: float | None = None

    def close(self, vocabulary: int, end: int) -> None:
        """Its figures, as transformers computes them: the mean log-probability of its tokens, the end of text's
        included (after the rules, at temperature 1); their compression ratio (compression_ratio)."""
        request, ended = self.request, self.request.end_logprob is not None
        picked = [logprob for logprob, _ in request.logprobs] + [request.end_logprob] * ended
        self.avg_logprob = sum(picked) / len(picked) if picked else 0.0
        self.compression_ratio = compression_ratio(self.tokens + [end] * ended, vocabulary)


@dataclass(eq=False)
class Track:
    """One file's way through the sequential algorithm: where it stands, and its segments so far."""

    listening: "Listening" = field(repr=False)
    features: np.ndarray  # (frames, bins): the whole file's
    frames: int  # its frames to decode (a file of up to 30 s: the whole window, padding included)
    audio_frames: int  # those that hold audio (transformers' attention mask: what word times read)
    duration: float
    timestamps: bool  # decoded with timestamps (over 30 s: always, as the windows move by them)
    language: int | None = None  # its language token (a multilingual model's)
    seek: int = 0
    attempt: int = 0  # the temperature tried now (Guards.temperatures)
    conditioned: bool = True  # its next window may open with the text before it (Listening.prefix_of)
    window: Window | None = None
    segments: list[dict] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish: str | None = None
    sent: int = 0  # segments already given out

    @property
    def done(self) -> bool:
        return self.seek >= self.frames

    def window_features(self) -> np.ndarray:
        """A window's frames from seek (3,000 in every public Whisper), the file's last window padded with zeros, as
        transformers pads it (numpy's: its MLX array is made where it is encoded, on the thread that owns MLX)."""
        window = self.listening.window_frames
        part = self.features[self.seek : self.seek + window]
        return np.pad(part, [(0, window - len(part)), (0, 0)])


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
    words: list[dict] | None = None  # every segment's words, where they were timed


def transcribe(models, files: list, *, language: str | None = None, task: str = "transcribe", timestamps: bool = False,
               words: bool = False, condition: bool = False, guards: Guards = Guards(), prompt: str | None = None,
               settings: Settings | None = None, given=(), **options) -> list[Transcription]:
    """Each file's Transcription (a path, a file's bytes, or its samples as audio.read gives them), decoded together
    in one batch at these settings (options as Settings' fields, over the model's generation defaults). A file over
    30 s is decoded window by window, each moving on from the last one's last timestamp, as transformers' long-form
    generate does; with `timestamps`, a short file too; with `words`, each segment's words and tokens timed
    (token_times, words_of); with `condition`, each window opens with the text before it. `max_tokens` counts a
    window's tokens."""
    listening = Listening.of(models, language, task, timestamps, guards, prompt, settings, given, options, words,
                             condition)
    tracks = [listening.track(file) for file in files]
    for _ in listen(tracks):
        pass
    return [listening.transcription(track) for track in tracks]


def stream_transcribe(models, file, *, language: str | None = None, task: str = "transcribe", timestamps: bool = True,
                      words: bool = False, condition: bool = False, guards: Guards = Guards(),
                      prompt: str | None = None, settings: Settings | None = None, given=(), **options) -> Iterator[dict]:
    """One file's segments as they are decided: with no guard set, each as soon as the timestamps after it show it
    final (its window's figures, avg_logprob and compression_ratio, None until the window ends); with guards, or
    with words, a window's once it ends (and passes them)."""
    listening = Listening.of(models, language, task, timestamps, guards, prompt, settings, given, options, words,
                             condition)
    for _, segment in listen([listening.track(file)]):
        yield segment


def warm_up(models, settings: Settings) -> None:
    """A second of silence transcribed on each decoding path the settings can take (the target alone, and drafting if
    they draft), so that first-call costs (compiling kernels, growing the allocator's pools) stay out of the first
    request's time."""
    silence = np.zeros(audio.SAMPLE_RATE, np.float32)
    paths = (False, True) if replace(settings, speculative=True).drafts(models) else (False,)
    for speculative in paths:
        transcribe(models, [silence], settings=replace(settings, speculative=speculative), max_tokens=4)


def listen(tracks: list[Track]) -> Iterator[tuple[Track, dict]]:
    """Files decoded window by window in one batch (one a decoding kind, as a fallback's temperature may change it),
    each segment yielded as it is decided: a file's next window joins as soon as its last ends, so that no file
    waits for another's."""
    if not tracks:
        return
    models = tracks[0].listening.models
    batches = {}  # a decoding kind (a window's temperature may change it) -> its batch
    joining, owners = [track for track in tracks if not track.done], {}  # id(a window's request) -> its track
    while joining or any(batch.rows for batch in batches.values()):
        kinds = {}
        for track in joining:
            request = track.listening.window(track)
            owners[id(request)] = track
            kinds.setdefault(request.settings.kind(models), []).append(track)
        for kind, starting in kinds.items():
            if kind not in batches:
                batches[kind] = batch_for(models, starting[0].window.request.settings, len(tracks))
            requests = [track.window.request for track in starting]
            encoding = batches[kind].encoding(requests)
            open_windows(models, encoding.finish()[0], starting)
            batches[kind].join(requests, encoding)
        joining = []
        for batch in [batch for batch in batches.values() if batch.rows]:
            for request, token, reason in batch.round():
                track = owners[id(request)]
                for segment in track.listening.token(track, token):
                    yield track, segment
                if reason:
                    cross = row_cross(batch, request) if track.listening.words else None
                    for segment in track.listening.ended(track, reason, cross):
                        yield track, segment
                    del owners[id(request)]
                    if not track.done:
                        joining.append(track)


def row_cross(batch, request):
    """A request's row's cross-attention in its batch's target cache (DecoderCache.row): what token_times reads,
    taken as the row ends, before it leaves (a beam search's row: its first beam's, the same)."""
    row = [row.request for row in batch.rows].index(request) * getattr(batch, "width", 1)  # (BeamBatch: beams a row)
    return batch.caches[0].row(row)


def open_windows(models, cache, tracks: list[Track]) -> None:
    """Before their windows join a batch, encoded together into `cache` (row i track i's): each track's language,
    detected from its first window where none was given; each window's no-speech probability, read after its start
    of transcript; and its opening, rules and most tokens."""
    whisper, target = tracks[0].listening.whisper, models.target
    prefixes = [track.window.prefix for track in tracks]
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
    """One call's way of listening (its language, task, guards, prompt and settings), and what it does with each
    file's `Track` window by window: each window's request, its tokens, its end."""

    whisper: Whisper
    models: object = field(repr=False)
    settings: Settings
    language: int | None  # the language token given (a multilingual model's); None: detected
    task: str
    timestamps: bool
    guards: Guards
    prefix: tuple[int, ...]  # <|startofprev|> and a prompt's tokens, before the start of transcript
    max_tokens: int | None  # as asked; None: what each window's opening leaves
    words: bool = False  # each segment's words and tokens timed (token_times, words_of)
    condition: bool = False  # each window opens with the text before it (transformers' condition_on_prev_tokens)

    @classmethod
    def of(cls, models, language: str | None, task: str, timestamps: bool, guards: Guards, prompt: str | None,
           settings: Settings | None, given, options: dict, words: bool = False, condition: bool = False) -> "Listening":
        whisper = Whisper.of(models)
        if words and not whisper.alignment_heads:
            raise OptionError("this model's generation config names no alignment_heads: it times no words", "words")
        args = models.target.args
        if any(not (0 <= layer < args.num_decoder_layers and 0 <= head < args.num_heads)
               for layer, head in whisper.alignment_heads):
            raise OptionError(f"this model's alignment_heads {list(whisper.alignment_heads)} name a decoder layer or "
                              f"head it does not have ({args.num_decoder_layers} layers of {args.num_heads} heads)")
        if task not in TASKS:
            raise OptionError(f"task must be transcribe or translate, not {task!r}", "task")
        if task == "translate" and not whisper.multilingual:
            raise OptionError("this model is English-only: it transcribes, and does not translate", "task")
        fixed = whisper.language_token(language) if language is not None and whisper.multilingual else None
        if language is not None and not whisper.multilingual:
            whisper.language_token(language)  # English-only: refuses any language
        settings = settings or Settings()
        if options.get("num_beams", settings.num_beams) > 1 and options.get("temp", 0) > 0:
            # sampling has one beam (openai-whisper's rule, and transformers'): each window then decodes as a fallback
            guards = replace(guards, temperatures=guards.temperatures or (options["temp"],))
            options = {**options, "temp": 0.0}
        settings = replace(settings, **options)
        given = set(given) | set(options)
        _, settings, _ = with_presets(models, settings, given=given, search=False)
        if settings.n > 1 or settings.num_return_sequences > 1:
            raise OptionError("n and num_return_sequences are not for audio: a file has one transcription (a beam "
                              "search's best beam)", "n")
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
        # each token's log-probability, for the guards and the segments' figures (a beam search keeps its best beam's)
        settings = replace(settings, logprobs=None if settings.num_beams > 1 else 0).check_models(models)
        if condition and whisper.previous is None and len(whisper.suppress) < 2:
            raise OptionError("this model's generation config has no prev_sot_token_id: it cannot condition on the "
                              "text before a window", "condition_on_previous_text")
        return cls(whisper, models, settings, fixed, task, timestamps, guards, prefix,
                   settings.max_tokens if "max_tokens" in given else None, words, condition)

    @property
    def window_frames(self) -> int:
        return window_frames(self.models.target)

    def track(self, file, max_seconds: float | None = None) -> Track:
        """A file (a path, its bytes, or its samples) read, and its features made: a file of up to a window (30 s)
        padded to it, as transformers pads it; a longer one at its whole length, decoded with timestamps (the windows move
        by them)."""
        samples = file if isinstance(file, np.ndarray) else audio.read(file, max_seconds)
        window = self.window_frames
        long = len(samples) // audio.HOP > window  # (transformers' long-form: over a window's frames, 3,000)
        if long and self.whisper.first_timestamp is None:
            raise OptionError("this model's generation config has no no_timestamps_token_id: it decodes files of up "
                              f"to its window, {window * audio.HOP / audio.SAMPLE_RATE:g} s, and this one is longer")
        frames = len(samples) // audio.HOP if long else window
        features = audio.log_mel(samples, self.models.target.args.num_mel_bins, frames)
        audio_frames = frames if long else -(-len(samples) // audio.HOP)
        return Track(self, features, frames, audio_frames, len(samples) / audio.SAMPLE_RATE, self.timestamps or long,
                     self.language)

    def window(self, track: Track) -> Request:
        """The request of the track's next window (its opening set once it is encoded: open_windows)."""
        temperature, seed = self.guards.temperatures[track.attempt], self.settings.seed
        if seed is not None:  # each window and each attempt its own random stream, reproducibly
            seed = (seed * 1_000_003 + track.seek * 31 + track.attempt) % 2**31
        searched = {} if temperature == 0 else dict(num_beams=1, num_return_sequences=1, logprobs=0)
        # (a window decoded hotter samples, with one beam, as transformers' fallback does; the next is searched again,
        # as openai-whisper's and faster-whisper's are: transformers' stays at one beam for the rest of the call)
        settings = replace(self.settings, temp=temperature, seed=seed, **searched)
        request = Request(track.window_features(), settings, ruled_logprobs=True)
        track.window = Window(request, track.seek, min(track.frames - track.seek, self.window_frames), temperature,
                              self.prefix_of(track))
        return request

    def prefix_of(self, track: Track) -> tuple[int, ...]:
        """What a track's next window opens with before its start of transcript: the prompt's prefix; or, conditioned
        on the text before (where the last window was decoded below temperature 0.5), <|startofprev|> and the last 223
        tokens of the prompt and the segments so far (a segment's closing pair of timestamps one token shorter), as
        transformers' generate conditions on them."""
        if not self.condition or not track.conditioned or not (track.segments or self.prefix):
            return self.prefix
        before = list(self.prefix[1:])  # the prompt, as transformers' first "segment"
        for segment in track.segments:
            tokens = segment["tokens"]
            first = self.whisper.first_timestamp
            closing_pair = first is not None and len(tokens) > 2 and tokens[-2] >= first
            before += tokens[:-1] if closing_pair else tokens
        previous = self.whisper.previous if self.whisper.previous is not None else self.whisper.suppress[-2]
        return (previous, *before[-(self.whisper.positions // 2 - 1):])

    def opened(self, track: Track) -> None:
        """The window's opening (its language known), its rules and its most tokens."""
        request = track.window.request
        request.opening = self.whisper.opening(track.language, self.task, track.timestamps, track.window.prefix)
        request.rules = self.whisper.rules(request.opening, track.timestamps)
        most = self.models.target.args.max_positions - len(request.opening.start)
        request.settings = replace(request.settings, max_tokens=min(self.max_tokens or most, most))

    def token(self, track: Track, token: int | None) -> list[dict]:
        """A token of the track's window: the segments it shows final (with no guard set, each once the pair of
        timestamps after the next is out: a window's last pair is part of its segment, an earlier one is not)."""
        if token is None:
            return []
        tokens, first = track.window.tokens, self.whisper.first_timestamp
        tokens.append(token)
        if self.guards.any or self.words or first is None or len(tokens) < 2 or tokens[-1] < first or tokens[-2] < first:
            return []
        final = self.whisper.window_segments(tokens, self.offset(track.window), track.window.frames)[0][:-1]
        new = [self.finished(segment, track.window) for segment in final[track.sent :]]
        track.sent = max(track.sent, len(final))
        return new

    def ended(self, track: Track, finish: str, cross=None) -> list[dict]:
        """The track's window is done: the segments it decided that were not
        given out yet, and the file moves on (or the window is decoded again
        hotter, or passed over as silence). With words, `cross` is its row's
        cross-attention (row_cross)."""
        window = track.window
        window.finish = finish
        window.close(self.whisper.vocabulary, self.whisper.end)
        retry = self.guards.retry(window) and track.attempt + 1 < len(self.guards.temperatures)
        silent = not retry and self.guards.silent(window)
        segments, advance = [], window.frames
        if not retry and not silent:
            segments, advance = self.whisper.window_segments(window.tokens, self.offset(window), window.frames)
            segments = [self.finished(segment, window) for segment in segments]
            if self.words and cross is not None:
                self.timed(segments, window, track.audio_frames - window.seek, cross, track)
        # (all that can fail is done: the track changes now, at once)
        track.stats = track.stats + window.request.stats
        if retry:
            track.attempt += 1  # (the seek stays: the same window again)
            return []
        new = segments[track.sent :]
        track.segments += segments
        track.attempt, track.window, track.finish, track.sent = 0, None, window.finish, 0
        track.conditioned = window.temperature < 0.5  # (a hot window's text is no guide: openai-whisper's rule)
        track.seek += advance
        return new

    def code_of(self, track: Track) -> str | None:
        """The track's language's code ("en"): its token's, or English for an English-only model."""
        names = {token: code.strip("<|>") for code, token in self.whisper.languages.items()}
        return names.get(track.language, None if self.whisper.multilingual else "en")

    def timed(self, segments: list[dict], window: Window, frames: int, cross, track: Track) -> None:
        """Each segment's tokens' times and its words (token_times, words_of: transformers' token timestamps)."""
        opening = list(window.request.opening.start)
        ended = [self.whisper.end] if window.request.end_logprob is not None else []
        times = token_times(self.models.target, cross, opening + window.tokens + ended, len(opening),
                            list(self.whisper.alignment_heads), frames)
        times = [round(self.offset(window) + time, 2) for time in times]
        times += times[-1:]  # (a window's last token ends where it starts)
        position = 0
        for segment in segments:
            count = len(segment["tokens"])
            segment["token_times"] = times[position : position + count]
            segment["words"] = words_of(segment["tokens"], times[position : position + count + 1],
                                        self.models.tokenizer, self.whisper.end, self.code_of(track) in SPACELESS)
            position += count

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
        tokens = [token for segment in track.segments for token in segment["tokens"]]
        words = [word for segment in track.segments for word in segment["words"]] if self.words else None
        return Transcription(self.text([token for token in tokens if token < self.whisper.end]), tokens,
                             self.code_of(track), track.duration, track.finish, track.stats, track.segments, self.task,
                             words)


FORMATS = ("json", "text", "srt", "verbose_json", "vtt")  # OpenAI's response_format


def render(transcription: Transcription, form: str) -> str:
    """A transcription as OpenAI's audio endpoints answer in each response_format: json ({"text"}), text, srt,
    verbose_json (text, the language's name, duration, segments; the words, where timed) or vtt (subtitles:
    segments with no text left out)."""
    if form == "text":
        return transcription.text + "\n"
    if form == "json":
        return json.dumps({"text": transcription.text})
    if form == "verbose_json":
        names = {}
        for name, code in LANGUAGE_NAMES.items():  # each code's first name ("chinese", not its alias "mandarin")
            names.setdefault(code, name)
        verbose = {"task": transcription.task, "language": names.get(transcription.language, transcription.language),
                   "duration": round(transcription.duration, 3), "text": transcription.text,
                   "segments": [{"id": i} | {key: value for key, value in segment.items() if key != "words"}
                                for i, segment in enumerate(transcription.segments)]}
        if transcription.words is not None:  # OpenAI's: the words, apart
            verbose["words"] = transcription.words
        return json.dumps(verbose)
    if form not in ("srt", "vtt"):
        raise OptionError(f"the format is one of {', '.join(FORMATS)}, not {form!r}", "response_format")
    mark = "," if form == "srt" else "."
    cues = []
    for i, segment in enumerate([segment for segment in transcription.segments if segment["text"].strip()], 1):
        span = f"{clock(segment['start'], mark)} --> {clock(segment['end'], mark)}"
        cues.append(f"{i}\n{span}\n{segment['text'].strip()}\n" if form == "srt" else f"{span}\n{segment['text'].strip()}\n")
    return ("" if form == "srt" else "WEBVTT\n\n") + "\n".join(cues)


def clock(seconds: float, mark: str) -> str:
    """HH:MM:SS,mmm (SubRip's) or HH:MM:SS.mmm (WebVTT's)."""
    milliseconds = round(seconds * 1000)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    return f"{hours:02d}:{minutes:02d}:{milliseconds // 1000:02d}{mark}{milliseconds % 1000:03d}"
