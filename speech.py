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
from dataclasses import dataclass, field, replace
from pathlib import Path
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
                   max_initial=generation.get("max_initial_timestamp_index"))

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

    def opening(self, language: int | None, task: str, timestamps: bool = False) -> Opening:
        """The start of transcript, the language and the task (a multilingual
        model's), then no-timestamps unless they are asked for: transformers'
        decoder prompt."""
        start = [self.start]
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

    def segments(self, tokens: list[int], duration: float, decode, timestamps: bool = True) -> list[dict]:
        """A window's output in segments ({start, end, text, tokens}), as its
        timestamps mark them: a segment runs from a timestamp to the next, and
        consecutive timestamps close one and open another; text after the last
        timestamp runs to the end of the audio. Without timestamps (not asked
        for, or none output), one segment of the whole."""
        first = self.first_timestamp
        if not timestamps or first is None or not any(token >= first for token in tokens):
            return [{"start": 0.0, "end": round(duration, 2), "text": decode(tokens), "tokens": tokens}]
        segments, start, text = [], None, []
        for token in tokens:
            if token < first:
                text.append(token)
                continue
            at = round((token - first) * TIMESTAMP_SECONDS, 2)
            if start is not None and text:
                segments.append({"start": start, "end": at, "text": decode(text), "tokens": text})
                start, text = None, []
            else:  # a segment's first timestamp (after an empty one: the later)
                start = at
        if text:  # no timestamp closed it: it runs to the end of the audio
            start = start or 0.0
            segments.append({"start": start, "end": max(start, round(duration, 2)), "text": decode(text), "tokens": text})
        return segments

    def detect(self, target, cache, rows: int) -> list[int]:
        """Each row's likeliest language token after the start of transcript
        alone, as transformers' detect_language decides it; the cache is left
        as it was."""
        logits = target.decode(mx.array([[self.start]] * rows), cache)[:, -1]
        ids = mx.array(sorted(self.languages.values()))
        chosen = ids[mx.argmax(logits[:, ids], axis=-1)]
        cache.trim(1)
        return [int(token) for token in chosen.tolist()]


@dataclass
class Transcription:
    """A file's text and the tokens that made it (the opening left out), its language and length, and its statistics."""

    text: str
    tokens: list[int]
    language: str | None
    duration: float  # seconds of audio
    finish_reason: str | None
    stats: Stats
    segments: list[dict] = field(default_factory=list)  # {start, end, text, tokens}: Whisper.segments
    task: str = "transcribe"


def transcribe(models, files: list, *, language: str | None = None, task: str = "transcribe", timestamps: bool = False,
               settings: Settings | None = None, given=(), **options) -> list[Transcription]:
    """Each file's Transcription (a path, a file's bytes, or its samples as
    audio.read gives them), decoded together in one batch at these settings
    (options as Settings' fields, over the model's generation defaults): a
    file of up to 30 s each; with `timestamps`, in timestamped segments."""
    job = Listening.of(models, files, language, task, timestamps, settings, given, options)
    tokens, finish = {id(request): [] for request in job.requests}, {}
    for request, token, reason in job.events():
        if token is not None:
            tokens[id(request)].append(token)
        if reason:
            finish[id(request)] = reason
    return [job.transcription(request, tokens[id(request)], finish.get(id(request))) for request in job.requests]


def stream_transcribe(models, file, *, language: str | None = None, task: str = "transcribe", timestamps: bool = True,
                      settings: Settings | None = None, given=(), **options) -> Iterator[dict]:
    """One file's segments ({start, end, text, tokens}) as they are decided:
    each as soon as the timestamp that closes it is out, the last (text no
    timestamp closed, or the whole without timestamps) when decoding ends."""
    job = Listening.of(models, [file], language, task, timestamps, settings, given, options)
    (request,), tokens, sent = job.requests, [], 0
    for _, token, _ in job.events():
        if token is None:
            continue
        tokens.append(token)
        if timestamps and job.whisper.first_timestamp is not None and token >= job.whisper.first_timestamp:
            closed = job.whisper.segments(tokens, job.durations[0], job.text)  # each closed by a timestamp
            yield from closed[sent:]
            sent = len(closed)
    yield from job.transcription(request, tokens, None).segments[sent:]


@dataclass
class Listening:
    """Files' requests, their opening and rules set (a language detected where none is given), joined to a batch."""

    whisper: Whisper
    models: object
    batch: object
    requests: list[Request]
    languages: list[int | None]  # each request's language token
    durations: list[float]
    task: str
    timestamps: bool

    @classmethod
    def of(cls, models, files: list, language: str | None, task: str, timestamps: bool, settings: Settings | None,
           given, options: dict) -> "Listening":
        whisper = Whisper.of(models)
        if task not in TASKS:
            raise OptionError(f"task must be transcribe or translate, not {task!r}")
        if task == "translate" and not whisper.multilingual:
            raise OptionError("this model is English-only: it transcribes, and does not translate")
        fixed = whisper.language_token(language) if language is not None and whisper.multilingual else None
        if language is not None and not whisper.multilingual:
            whisper.language_token(language)  # English-only: refuses any language
        settings = replace(settings or Settings(), **options)
        given = set(given) | set(options)
        _, settings, _ = with_presets(models, settings, given=given, search=False)
        # The decoder's positions hold the opening and the output: by default the output takes what the opening
        # leaves (transformers' max_length of 448 does the same); asked for more, it is refused.
        positions = models.target.args.max_positions
        opened = len(whisper.opening(next(iter(whisper.languages.values()), None), task, timestamps).start)
        if "max_tokens" not in given:
            settings = replace(settings, max_tokens=positions - opened)
        elif settings.max_tokens + opened > positions:
            raise OptionError(f"max_tokens is {settings.max_tokens:,}: with the {opened} tokens the decoder opens "
                              f"with, this model's {positions} positions leave {positions - opened} for the output",
                              "max_tokens")
        settings = settings.check_models(models)
        sources, durations = [], []
        for file in files:
            samples = file if isinstance(file, np.ndarray) else audio.read(file)
            duration = len(samples) / audio.SAMPLE_RATE
            if duration > audio.WINDOW_SECONDS:
                name = file if isinstance(file, (str, Path)) else "a file"  # its samples: the caller knows which
                raise OptionError(f"{name} is {duration:.1f} s long: files of up to {audio.WINDOW_SECONDS} s "
                                  "transcribe here so far")
            sources.append(mx.array(audio.log_mel(samples, models.target.args.num_mel_bins)))
            durations.append(duration)
        requests = [Request(source, settings) for source in sources]
        batch = batch_for(models, settings, len(requests))
        encoding = batch.encoding(requests)
        if fixed is None and whisper.multilingual:
            chosen = whisper.detect(models.target, encoding.finish()[0], len(requests))
        else:
            chosen = [fixed] * len(requests)
        for request, token in zip(requests, chosen):
            request.opening = whisper.opening(token, task, timestamps)
            request.rules = whisper.rules(request.opening, timestamps)
        batch.join(requests, encoding)
        return cls(whisper, models, batch, requests, chosen, durations, task, timestamps)

    def events(self) -> Iterator:
        """The batch's rounds' events until every row is done."""
        while self.batch.rows:
            yield from self.batch.round()

    def text(self, ids: list[int]) -> str:
        return self.models.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def transcription(self, request: Request, tokens: list[int], finish: str | None) -> Transcription:
        i = self.requests.index(request)
        names = {token: code.strip("<|>") for code, token in self.whisper.languages.items()}
        language = names.get(self.languages[i], None if self.whisper.multilingual else "en")
        return Transcription(self.text(tokens), tokens, language, self.durations[i], finish, request.stats,
                             self.whisper.segments(tokens, self.durations[i], self.text, self.timestamps), self.task)


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
