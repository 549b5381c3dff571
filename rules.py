"""Rules: a row's bans on its next token that are not penalties, as small objects with one interface.

A rule says which tokens may not come next, given the tokens before: the
row's decoder opening and its output, and, when a round verifies drafts,
the drafts before the position. Every batch applies a row's rules at every
position it decides (the target's, after the penalties, before any forced
token), so that regular, drafted and beam decoding all keep them and
speculative decoding stays exact: a draft a rule bans has probability 0.

A rule that reads no token before it (`looks_back` 0) is one fixed ban,
applied on the device with the penalties at no cost a round. A rule that
reads them is evaluated on the host, at each position, with the tokens
before it; a round with such a row reads its tokens (or drafts) back before
the target's pass. Drafters apply fixed bans only: the target's verdict keeps
the others, at some cost in accepted drafts. Whisper's timestamp rule, which
every transcription with timestamps has, is the exception: it runs on the
device (`timestamp_bans`, from the tokens the batch keeps there), so that a
round waits for no host read and drafts keep it too; its `banned` is the
reference the device's bans are tested against.
"""

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx


class Rule:
    """A ban on the next token: `banned(before)` gives the tokens that may not
    follow `before` (a range, or any collection of ids); `looks_back`, how many
    of the tokens before it reads (0: none, a fixed ban; None: all of them).
    `first_only`: a fixed ban of the first output token only (applied on the
    device where a row decides its first token)."""

    looks_back: int | None = 0
    first_only = False
    on_device = False  # applied by the batch on the device (sampling.RowPenalties), not by fixed or reading bans

    def banned(self, before: Sequence[int]) -> Iterable[int]:
        raise NotImplementedError


@dataclass(frozen=True)
class BadWords(Rule):
    """transformers' NoBadWordsLogitsProcessor (`bad_words_ids`): a sequence's
    last token is banned where the tokens before it end with the rest of it;
    a sequence of one token is never output (Marian's `<pad>`)."""

    sequences: tuple[tuple[int, ...], ...]

    @property
    def looks_back(self) -> int:
        return max(len(sequence) for sequence in self.sequences) - 1

    def banned(self, before: Sequence[int]) -> list[int]:
        before = list(before)
        return [sequence[-1] for sequence in self.sequences
                if len(sequence) == 1 or before[len(before) - len(sequence) + 1 :] == list(sequence[:-1])]


@dataclass(frozen=True)
class Timestamps(Rule):
    """transformers' WhisperTimeStampLogitsProcessor, its bans: no
    <|notimestamps|>; timestamps in pairs (after a pair, text; after a lone
    one, another timestamp or the end of text); none earlier than the last;
    the first output token a timestamp no later than `max_initial` steps of
    0.02 s. Its other rule, a timestamp whenever the timestamps' probability
    together beats every text token's, reads the logits: the batch applies it
    (sampling.RowPenalties) for the rows with this rule, after every ban, as
    transformers runs this processor after all the others."""

    first: int  # <|0.00|>: it and every token after it are timestamps
    no_timestamps: int
    end: int  # the end of text: every token below it is text
    opening: int  # the tokens the decoder opens with: the output follows them
    vocabulary: int
    max_initial: int | None = None

    looks_back = None
    on_device = True  # timestamp_bans: the same bans, from the tokens on the device

    def banned(self, before: Sequence[int]) -> list:
        output = list(before[self.opening :])
        banned = [range(self.no_timestamps, self.no_timestamps + 1)]
        last = len(output) >= 1 and output[-1] >= self.first
        penultimate = len(output) < 2 or output[-2] >= self.first
        if last:
            banned.append(range(self.first, self.vocabulary) if penultimate else range(0, self.end))
        stamps = [token for token in output if token >= self.first]
        earliest = self.first if not stamps else stamps[-1] if last and not penultimate else stamps[-1] + 1
        banned.append(range(self.first, earliest))
        if not output:
            banned.append(range(0, self.first))
            if self.max_initial is not None:
                banned.append(range(self.first + self.max_initial + 1, self.vocabulary))
        return banned


def fixed_bans(rules: list[tuple[Rule, ...]], vocabulary: int, first_only: bool = False) -> mx.array | None:
    """(B, V): each row's bans from rules that read nothing before them (of
    its first output token only, with `first_only`); None when no row has one."""
    fixed = [[rule for rule in row if rule.looks_back == 0 and rule.first_only == first_only and not rule.on_device]
             for row in rules]
    if not any(fixed):
        return None
    mask = np.zeros((len(rules), vocabulary), bool)
    for row, row_rules in enumerate(fixed):
        for rule in row_rules:
            mark(mask[row], rule.banned(()))
    return mx.array(mask)


def reading_bans(rules: list[tuple[Rule, ...]], tokens: list[list[int]], queries: int, vocabulary: int) -> mx.array:
    """(B, queries, V): each row's bans from rules that read the tokens before
    them, at each of the last `queries` prefixes of the row's tokens (its
    opening, output and any drafts: lengths L - queries + 1 to L)."""
    mask = np.zeros((len(rules), queries, vocabulary), bool)
    for row, (row_rules, seen) in enumerate(zip(rules, tokens)):
        for rule in row_rules:
            if rule.looks_back == 0 or rule.on_device:
                continue
            for query in range(queries):
                before = seen[: len(seen) - queries + 1 + query]
                if rule.looks_back is not None:
                    before = before[max(len(before) - rule.looks_back, 0) :]
                mark(mask[row, query], rule.banned(before))
    return mx.array(mask)


class TimestampRows:
    """The rows' Timestamps rules as arrays (B,), for timestamp_bans; `any`: whether a row has one."""

    def __init__(self, rules: list[tuple[Rule, ...]], vocabulary: int):
        found = [next((rule for rule in row if isinstance(rule, Timestamps)), None) for row in rules]
        self.any = any(rule is not None for rule in found)
        # A row without the rule: its first timestamp past the vocabulary, and nothing else banned.
        self.first, self.no_timestamps, self.end, self.latest_first = (mx.array(values, dtype=mx.int32) for values in zip(*(
            (vocabulary, -1, 0, vocabulary) if rule is None else
            (rule.first, rule.no_timestamps, rule.end,
             vocabulary if rule.max_initial is None else rule.first + rule.max_initial)
            for rule in found)))
        self.ids = mx.arange(vocabulary)  # made once, not at every step

    def bans(self, tokens: mx.array, positions: mx.array) -> mx.array:
        return timestamp_bans(tokens, positions, self.first, self.no_timestamps, self.end, self.latest_first, self.ids)


@mx.compile  # some 30 operations, traced again for a batch's size, a round's drafts and each block of tokens (Batch.tokens)
def timestamp_bans(tokens, positions, first, no_timestamps, end, latest_first, vocabulary):
    """(B, n, V): Timestamps.banned at each of the last n prefixes of each row
    of tokens (B, L: its opening, output and any drafts, padded on the left),
    `positions` (B, n) the output's length in each prefix; the rules' fields
    as arrays (B,), a row without the rule has a first timestamp past the
    vocabulary (V,) and bans nothing."""
    L, n = tokens.shape[1], positions.shape[1]
    ends = mx.arange(L - n + 1, L + 1)  # each prefix's length
    index = mx.arange(L)[None, None]
    output = (index < ends[None, :, None]) & (index >= (ends[None] - positions)[..., None])  # (B, n, L)
    stamp_at = mx.where(output & (tokens >= first[:, None])[:, None], index, -1).max(axis=-1)  # the last timestamp's index
    stamp = mx.take_along_axis(tokens, mx.maximum(stamp_at, 0), axis=1)
    first = first[:, None]
    last = (positions >= 1) & (tokens[:, ends - 1] >= first)
    penultimate = (positions < 2) | (tokens[:, mx.maximum(ends - 2, 0)] >= first)
    earliest = mx.where(stamp_at < 0, first, mx.where(last & ~penultimate, stamp, stamp + 1))
    v, first = vocabulary[None, None], first[..., None]
    after_pair = mx.where(penultimate[..., None], v >= first, v < end[:, None, None])
    at_start = (positions == 0)[..., None] & ((v < first) | (v > latest_first[:, None, None]))
    banned = (v == no_timestamps[:, None, None]) | (last[..., None] & after_pair) | ((v >= first) & (v < earliest[..., None]))
    return (banned | at_start) & (first < vocabulary.shape[0])


def mark(mask: np.ndarray, banned: Iterable) -> None:
    """Set `banned` (a range, ids, or a list of ranges) in a row's (V,) mask."""
    if isinstance(banned, range):
        mask[banned.start : banned.stop : banned.step] = True
    elif isinstance(banned, list) and banned and isinstance(banned[0], range):
        for part in banned:
            mark(mask, part)
    else:
        mask[list(banned)] = True
