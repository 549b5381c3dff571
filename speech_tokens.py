"""Whisper's tokens and what they mean: a converted model's special tokens (its generation config, as
transformers' Whisper `generate` reads it), the openings, the rules, the spoken language, the no-speech
probability, and a window's segments by its timestamps. speech.py decodes with them.

The start of transcript, the language and task tokens, the no-timestamps
token, the tokens suppressed everywhere and those suppressed first come from
generation_config.json; the timestamps follow no-timestamps, a step of
0.02 s each; <|nospeech|> comes before no-timestamps.
"""

import math
import string
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx
import numpy as np

from errors import OptionError
from options import Opening
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
    alignment_heads: tuple[tuple[int, int], ...] = ()  # (layer, head) pairs whose cross-attention follows the audio

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
                   previous=generation.get("prev_sot_token_id"), positions=args.max_positions,
                   alignment_heads=tuple(tuple(pair) for pair in generation.get("alignment_heads") or ()))

    @property
    def first_timestamp(self) -> int | None:
        return None if self.no_timestamps is None else self.no_timestamps + 1

    @property
    def multilingual(self) -> bool:
        return bool(self.languages)  # (Whisper.of reads the config's is_multilingual into languages)

    def language_token(self, language: str) -> int | None:
        """"en", "<|en|>" or a name transformers takes ("english") -> its token (None: English, to an English-only
        model); OptionError naming the codes."""
        code = LANGUAGE_NAMES.get(language.lower(), language.lower()).strip("<|>")
        token = self.languages.get(f"<|{code}|>")
        if token is None and not self.languages and code == "en":
            return None  # an English-only model: English is what it hears (OpenAI's clients often say so)
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
            # in float32, as transformers computes it from its frame count (58 frames are 29 steps, not float64's 28)
            steps = int(np.float32(frames) * np.float32(0.01) / np.float32(TIMESTAMP_SECONDS))
            last = float(stamps[-1] - first) if stamps and stamps[-1] != first else steps
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
        if not text or not text.strip():
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


SPACELESS = ("zh", "ja", "th", "lo", "my", "yue")  # languages written without spaces between words: a word a character
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
    # and the other names openai-whisper and transformers take for some of them
    "burmese": "my", "valencian": "ca", "flemish": "nl", "haitian": "ht", "letzeburgesch": "lb", "pushto": "ps",
    "panjabi": "pa", "moldavian": "ro", "moldovan": "ro", "sinhalese": "si", "castilian": "es", "mandarin": "zh",
}


def compression_ratio(tokens: list[int], vocabulary: int) -> float:
    """Tokens' bytes (each in the fewest bytes the vocabulary takes) over their zlib-compressed bytes: how
    repetitive a window's output is, as transformers measures it."""
    width = int(math.log2(vocabulary) / 8) + 1
    data = b"".join(token.to_bytes(width, "little") for token in tokens)
    return len(data) / len(zlib.compress(data))


MEDIAN_FILTER_WIDTH = 7  # transformers' WhisperConfig default, and every public checkpoint's


def token_times(target, cross, tokens: list[int], opened: int, heads: list[tuple[int, int]], frames: int) -> list[float]:
    """Each output token's time in its window, in seconds, as transformers'
    return_token_timestamps finds it: the alignment heads' cross-attention
    weights, from one pass of the decoder over the window's opening and
    output (its end of text included) but the last token (as generate has
    them, a step a token), normalised over the tokens, median-filtered over
    time and averaged over the heads, then dynamic time warping from tokens
    to the audio's frames (`frames` of the window hold audio: the rest is
    cut). `tokens` is the opening and the output; `cross`, one row's cache
    (DecoderCache.row). The last token, with no row of its own, takes
    the time of the one before; with one output token, every time is 0."""
    inputs = tokens[:-1]
    if len(inputs) <= opened:
        return [0.0] * (len(tokens) - opened)
    captured = target.cross_attention_weights(mx.array([inputs]), cross, {layer for layer, _ in heads})
    weights = mx.stack([captured[layer][0, head] for layer, head in heads])  # (heads, inputs, positions)
    length = max(1, min(audio_positions(target), frames // 2))
    weights = np.array(weights[:, opened:, :length].astype(mx.float32))
    with np.errstate(invalid="ignore", divide="ignore"):  # one row: a deviation of 0, as transformers divides by it
        weights = (weights - weights.mean(axis=-2, keepdims=True)) / weights.std(axis=-2, keepdims=True)
    matrix = median_filtered(weights, MEDIAN_FILTER_WIDTH).mean(axis=0)
    text, time = warped(-matrix.astype(np.float64))
    jumps = np.pad(np.diff(text), (1, 0), constant_values=1).astype(bool)
    times = [float(t) for t in time[jumps] * TIMESTAMP_SECONDS]
    return times + times[-1:]


def audio_positions(target) -> int:
    """The encoder's positions a window takes (1,500 for 30 s: its frames over the stem's stride)."""
    return target.args.encoder_positions or target.args.max_positions


def window_frames(target) -> int:
    """The feature frames the encoder reads at once: 3,000 (30 s) in every public Whisper; a model made with a
    shorter max_source_positions reads, and is decoded, a shorter window at a time."""
    return audio_positions(target) * FRAMES_PER_STEP


def median_filtered(x: np.ndarray, width: int) -> np.ndarray:
    """A median over `width` steps along the last axis, its edges reflected (transformers' _median_filter)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.partition(windows, pad, axis=-1)[..., pad]


def warped(cost_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic time warping of (tokens, times) costs: the cheapest monotonic
    path from the first pair to the last, as (token indices, time indices),
    with transformers' float32 costs and its tie-breaking. Each anti-diagonal
    of the cost table depends only on the two before it: it is computed at
    once."""
    rows, columns = cost_of.shape
    cost = np.full((rows + 1, columns + 1), np.inf, np.float32)
    trace = np.full((rows + 1, columns + 1), -1, np.int8)
    cost[0, 0] = 0
    for diagonal in range(2, rows + columns + 1):
        i = np.arange(max(1, diagonal - columns), min(rows, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        chosen = np.where(step == 0, c0, np.where(step == 1, c1, c2))
        cost[i, j] = cost_of[i - 1, j - 1] + chosen.astype(np.float64)
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j, text, time = rows, columns, [], []
    while i > 0 or j > 0:
        text.append(i - 1)
        time.append(j - 1)
        move = trace[i, j]
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    return np.array(text[::-1]), np.array(time[::-1])


# transformers' (openai-whisper's, and ¡): marks that join the word after them, and those that join the word before.
PUNCTUATION_BEFORE, PUNCTUATION_AFTER = "\"'“¡¿([{-", "\"'.。,，!！?？:：”)]}、"


def words_of(tokens: list[int], times: list[float], tokenizer, end: int, spaceless: bool = False) -> list[dict]:
    """A segment's text tokens (those before `end`, the end of text) in words
    ({word, start, end}) as openai-whisper and transformers make them, each
    token k timed from times[k] to times[k + 1]. Tokens that make a character
    only together (a character's bytes split) go together. In a language
    written without spaces (`spaceless`) each such group is a word; in the
    others a word starts at a leading space or at ASCII punctuation. Then an
    opening mark after a space joins the word after it, and a closing mark the
    word before it. A word runs from its first token's time to the time of
    the token after its last."""
    units, pending, at = [], [], 0  # [text, first token's index, last's]: whole characters
    whole = tokenizer.decode([token for token in tokens if token < end])
    for i, token in enumerate(tokens):
        if token >= end:
            continue
        pending.append(i)
        text = tokenizer.decode([tokens[k] for k in pending])
        # (bytes that never make a character, whatever follows them, are a unit as they are)
        bad = at + text.index("\ufffd") if "\ufffd" in text else None
        if bad is None or bad >= len(whole) or whole[bad] == "\ufffd":
            units.append([text, pending[0], i])
            pending, at = [], at + len(text)
    words = []
    for unit in units:
        # (`in` tests a substring, not each character: openai-whisper's test, which an empty text passes)
        if spaceless or not words or unit[0].startswith(" ") or unit[0].strip() in string.punctuation:
            words.append(unit)
        else:
            words[-1][0] += unit[0]
            words[-1][2] = unit[2]
    for i in range(len(words) - 2, -1, -1):  # opening marks, from the last word back
        before, after = words[i], words[i + 1]
        if before[0].startswith(" ") and before[0].strip() in PUNCTUATION_BEFORE:
            after[0], after[1] = before[0] + after[0], before[1]
            words.pop(i)
    kept = words[:1]
    for word in words[1:]:  # closing marks, from the first word on
        if not kept[-1][0].endswith(" ") and word[0] in PUNCTUATION_AFTER:
            kept[-1][0] += word[0]
            kept[-1][2] = word[2]
        else:
            kept.append(word)
    return [{"word": text.strip(), "start": times[first], "end": times[last + 1]} for text, first, last in kept
            if text.strip()]
