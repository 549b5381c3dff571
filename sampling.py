"""From logits to tokens: temperature, top-k and top-p, each row of a batch with its own settings and random stream.

`Sampling` is one prompt's setting; `RowSampling` the settings of a batch's
rows as arrays over its first axis, so that rows sampling differently (or not
at all: temperature 0 is greedy) decode together. The regular path, the
drafts and the acceptance rule all go through `logits_to_probs` and `sample`.

Each row draws from a random stream of its own, keyed by its seed and by the
position in its output the draw decides, never by what else shares its
batch: a seeded row gives the same draws alone or in any batch.
"""

from dataclasses import dataclass

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx
import numpy as np

import rules

# What a draw at a position decides: a draft, a draft's acceptance, the target's token.
DRAFT, ACCEPT, TOKEN = range(3)


@dataclass(frozen=True)
class Penalties:
    """What a row's output so far does to its next logits, before temperature
    (as transformers and vLLM apply them): a token already seen has its
    logit divided by `repetition` when positive, multiplied when negative
    (transformers' RepetitionPenaltyLogitsProcessor, where the decoder's
    start token counts as seen); minus `presence` once it has been output,
    minus `frequency` for each time (OpenAI's rule); the end of text, and
    any other token in `ends`, masked until `min_tokens` tokens are out; `bias`,
    (token, bias) pairs, added to those tokens' logits (OpenAI's
    logit_bias); and any token that would complete an n-gram of
    `no_repeat_ngram` tokens already in the output (the start token
    included) masked (transformers' NoRepeatNGramLogitsProcessor); the
    first output token forced, and the end of text at a position, as
    transformers' ForcedBOS- and ForcedEOSTokenLogitsProcessor force them
    (the forced token's logit 0, every other -inf). `rules` ban tokens
    after the penalties, before the forced tokens (rules.py)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    min_tokens: int = 0
    bias: tuple[tuple[int, float], ...] = ()
    no_repeat_ngram: int = 0
    ends: tuple[int, ...] = ()  # tokens besides the end of text that end a row (stop_token_ids)
    forced_first: int | None = None  # the first output token, whatever the logits (forced_bos_token_id)
    forced_end_at: int | None = None  # the output position where the end of text is forced (forced_eos_token_id)
    rules: tuple = ()  # rules.Rule objects: bans that are not penalties (bad_words_ids, a family's own)


class RowPenalties:
    """A batch's rows' Penalties as arrays over its first axis, applied to
    logits (B, n, V) given what each row had output before each of its n
    positions. Rows without penalties hold neutral values, which change nothing."""

    def __init__(self, penalties: list[Penalties], openings: list, eos: int, vocabulary: int,
                 forced_end: int | None = None):
        # Each row's decoder opening (its start token, or tokens), which counts as seen.
        openings = [opening if isinstance(opening, tuple) else (opening,) for opening in openings]
        self.opened = dense([[(token, 1.0) for token in opening] for opening in openings], vocabulary)[:, None] > 0
        self.forced_end = eos if forced_end is None else forced_end  # forced_eos_token_id
        self.repetition, self.presence, self.frequency, self.min_tokens = (
            mx.array([getattr(p, name) for p in penalties], dtype=mx.float32)
            for name in ("repetition", "presence", "frequency", "min_tokens"))
        self.bias = mx.zeros((len(penalties), 1))  # broadcast: no row has a bias
        if any(p.bias for p in penalties):
            self.bias = dense([p.bias for p in penalties], vocabulary)
        self.ends = mx.arange(vocabulary)[None] == eos  # (1 or B, V): what min_tokens holds back
        if any(p.ends for p in penalties):
            self.ends = dense([[(eos, 1.0)] + [(t, 1.0) for t in p.ends] for p in penalties], vocabulary) > 0
        self.ngram = mx.array([p.no_repeat_ngram for p in penalties])
        self.longest_ngram = max(p.no_repeat_ngram for p in penalties)
        self.forced_first, self.forced_end_at = (
            mx.array([-1 if getattr(p, name) is None else getattr(p, name) for p in penalties])
            for name in ("forced_first", "forced_end_at"))
        self.rules = [p.rules for p in penalties]
        self.fixed_bans = rules.fixed_bans(self.rules, vocabulary)  # (B, V) or None
        self.first_bans = rules.fixed_bans(self.rules, vocabulary, first_only=True)  # of the first output token only
        # Whisper's timestamp rule that reads the logits, after every ban (rules.Timestamps): each row's first timestamp
        self.timestamp_rows = rules.TimestampRows(self.rules, vocabulary)  # its bans, on the device
        self.timestamps = self.timestamp_rows.first if self.timestamp_rows.any else None
        self.vocabulary = vocabulary

    @classmethod
    def of(cls, penalties: list[Penalties], openings: list, eos: int, vocabulary: int,
           forced_end: int | None = None) -> "RowPenalties | None":
        """None when no row has any: decoding then costs nothing more."""
        return cls(penalties, openings, eos, vocabulary, forced_end) if any(p != Penalties() for p in penalties) else None

    @property
    def needs_tokens(self) -> bool:
        """Whether apply needs the rows' tokens on the device (for no_repeat_ngram, Whisper's timestamps), not only
        their counts."""
        return self.longest_ngram > 0 or self.timestamps is not None

    @property
    def reads_tokens(self) -> bool:
        """Whether a row has a rule that reads the tokens before it on the host: apply then takes them (`history`)."""
        return any(rule.looks_back != 0 and not rule.on_device for row in self.rules for rule in row)

    def apply(self, logits: mx.array, counts: mx.array, positions: mx.array, tokens: mx.array | None = None,
              history: list[list[int]] | None = None) -> mx.array:
        """logits (B, n, V); counts (B, n, V): each token's count in the row's
        output before each position; positions (B, n): the output position
        each decides (its count of tokens before it); tokens (B, L), when
        needs_tokens: each row's opening, output and any drafts, padded
        on the left with -1, the n positions deciding what follows its last
        n prefixes (lengths L - n + 1 to L); history, the same as lists on
        the host, for the rules that read them (None: those rules are not
        applied, as drafters leave them to the target)."""
        banned = mx.array(False)
        if self.longest_ngram > 0:
            banned = ngram_bans(tokens, self.ngram, self.longest_ngram, logits.shape[1], logits.shape[-1])
        if self.timestamps is not None:
            banned = banned | self.timestamp_rows.bans(tokens, positions)
        if self.fixed_bans is not None:
            banned = banned | self.fixed_bans[:, None]
        if self.first_bans is not None:
            banned = banned | ((positions == 0)[..., None] & self.first_bans[:, None])
        if history is not None and self.reads_tokens:
            banned = banned | rules.reading_bans(self.rules, history, logits.shape[1], self.vocabulary)
        return _penalize(logits, counts, positions, self.repetition, self.presence, self.frequency, self.min_tokens,
                         self.bias, self.ends, self.opened, banned, self.forced_first, self.forced_end_at, self.forced_end,
                         self.timestamps)


def dense(pairs: list, vocabulary: int) -> mx.array:
    """(B, V): each row's (token, value) pairs, zeros elsewhere."""
    table = np.zeros((len(pairs), vocabulary), np.float32)
    for row, row_pairs in enumerate(pairs):
        for token, value in row_pairs:
            table[row, token] = value
    return mx.array(table)


@mx.compile  # one pass over the logits, not one per rule: on a CPU each operation costs a dispatch
def _penalize(logits, counts, positions, repetition, presence, frequency, min_tokens, bias, ends, opened, banned,
              forced_first, forced_end_at, forced_end, timestamps=None):
    logits = logits.astype(mx.float32)
    vocabulary = mx.arange(logits.shape[-1])
    seen = (counts > 0) | opened
    repetition = repetition[:, None, None]
    logits = mx.where(seen, mx.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - presence[:, None, None] * (counts > 0) - frequency[:, None, None] * counts + bias[:, None]
    early = positions < min_tokens[:, None]
    logits = mx.where((early[..., None] & ends[:, None]) | banned, -mx.inf, logits)
    if timestamps is not None:  # Whisper's rows' first timestamp (the vocabulary's size for other rows)
        stamp = vocabulary >= timestamps[:, None, None]
        # transformers' comparison, in log-probabilities as it rounds them: the timestamps' together against the
        # likeliest text token's
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        together = mx.logsumexp(mx.where(stamp, logprobs, -mx.inf), axis=-1, keepdims=True)
        text = mx.where(stamp, -mx.inf, logprobs).max(axis=-1, keepdims=True)
        logits = mx.where(~stamp & (together > text), -mx.inf, logits)
    # Every token banned (no_repeat_ngram_size past the vocabulary): the row ends here, with the end of text.
    exhausted = (logits == -mx.inf).all(axis=-1, keepdims=True)
    logits = mx.where(exhausted & (vocabulary == forced_end), 0.0, logits)
    # Forced tokens last, as transformers applies its processors: nothing before them can take them away.
    first = ((positions == 0) & (forced_first[:, None] >= 0))[..., None]
    logits = mx.where(first, mx.where(vocabulary == forced_first[:, None, None], 0.0, -mx.inf), logits)
    last = (positions == forced_end_at[:, None])[..., None]
    return mx.where(last, mx.where(vocabulary == forced_end, 0.0, -mx.inf), logits)


@mx.compile  # some 25 operations in one graph, traced again only as the tokens' width grows (Batch.tokens)
def ngram_bans(tokens: mx.array, sizes: mx.array, longest: int, queries: int, vocabulary: int) -> mx.array:
    """(B, queries, V) True where a token would repeat an n-gram: for each of
    the last `queries` prefixes of each row of tokens (B, L, padded on the
    left with -1), the tokens that followed an earlier occurrence of the
    prefix's last n - 1 tokens, n the row's size (0: none)."""
    B, L = tokens.shape
    ends = mx.arange(L - queries + 1, L + 1)  # the prefixes' lengths
    candidate = mx.arange(L)  # where a token that would be banned stands
    match = (candidate[None, None] < ends[None, :, None]) & (sizes[:, None, None] > 0) & (tokens[:, None] >= 0)
    for back in range(1, longest):  # the candidate's n - 1 tokens before it against the prefix's last n - 1
        shift = min(back, L)  # a candidate this near the start has nothing so far before it
        before = mx.concatenate([mx.full((B, shift), -1, tokens.dtype), tokens[:, : L - shift]], axis=1)
        last = tokens[:, mx.maximum(ends - back, 0)]
        same = (before[:, None] == last[:, :, None]) & (before[:, None] >= 0)
        match = match & (same | (back >= sizes)[:, None, None])
    rows = mx.broadcast_to(mx.arange(B)[:, None, None], match.shape)
    prefixes = mx.broadcast_to(mx.arange(queries)[None, :, None], match.shape)
    banned = mx.broadcast_to(mx.maximum(tokens, 0)[:, None], match.shape)
    return mx.zeros((B, queries, vocabulary)).at[rows, prefixes, banned].add(match.astype(mx.float32)) > 0


def log_probabilities(logits: mx.array, chosen: mx.array, top: int):
    """The model's own log-probabilities (raw logits (B, n, V), before any
    processor or temperature) of the chosen tokens (B, n), and the `top` most
    likely tokens' ids and log-probabilities, most likely first (B, n, top)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, chosen[..., None].astype(mx.int32), axis=-1)[..., 0]
    if top == 0:
        return picked, None, None
    ids = mx.argpartition(-logprobs, top - 1, axis=-1)[..., :top]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return picked, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def one_hot(tokens: mx.array, size: int) -> mx.array:
    """tokens (...) -> (..., size) float32 counts."""
    return (tokens[..., None] == mx.arange(size)).astype(mx.float32)


@dataclass(frozen=True)
class Sampling:
    temp: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


def random_key(seed: int | None) -> tuple[int, int]:
    """A row's random stream: from its seed, or (None) drawn from MLX's global
    generator, so that mx.random.seed makes unseeded runs reproducible."""
    if seed is None:
        return tuple(mx.random.randint(0, 2**31 - 1, (2,)).tolist())
    return tuple(mx.random.split(mx.random.key(seed))[0].tolist())  # hashed: nearby seeds share no draws


class RowSampling:
    """A batch's rows' settings (and random streams), as arrays over the batch's
    first axis; the parts no row uses are None, and cost nothing."""

    def __init__(self, samplings: list[Sampling], keys: list[tuple[int, int]] | None = None):
        self.rows = len(samplings)
        self.greedy = [s.temp == 0 for s in samplings]
        self.all_greedy = all(self.greedy)
        self.temp = mx.array([s.temp if s.temp > 0 else 1.0 for s in samplings])  # greedy rows' at 1: unused
        self.top_k = mx.array([s.top_k for s in samplings]) if any(s.top_k > 0 for s in samplings) else None
        self.top_p = mx.array([s.top_p for s in samplings]) if any(s.top_p < 1 for s in samplings) else None
        self.is_greedy = mx.array(self.greedy)
        self.keys = None if self.all_greedy or keys is None else mx.array(keys, dtype=mx.uint32)

    @classmethod
    def of(cls, sampling: "Sampling | RowSampling", rows: int) -> "RowSampling":
        return sampling if isinstance(sampling, RowSampling) else cls([sampling] * rows)

    def keys_at(self, positions: mx.array, purpose: int) -> mx.array:
        """Each row's key for its draws at these output positions, (B, ...) -> (B, ..., 2)."""
        assert self.keys is not None, "rows that sample need their random streams"
        counters = (positions.astype(mx.uint32) * 3 + purpose).astype(mx.uint32)
        shape = (self.rows,) + (1,) * (positions.ndim - 1)
        high = mx.broadcast_to(self.keys[:, 0].reshape(shape), counters.shape)
        return mx.stack([high, mx.bitwise_xor(self.keys[:, 1].reshape(shape), counters)], axis=-1)


def per_row(values: mx.array, like: mx.array) -> mx.array:
    """(B,) values shaped to broadcast over `like`'s (B, ..., V)."""
    return values.reshape((-1,) + (1,) * (like.ndim - 1))


def logits_to_probs(logits: mx.array, sampling: "Sampling | RowSampling") -> mx.array:
    """Logits (B, ..., vocab) -> float32 probabilities after each row's
    temperature, top-k and top-p (a greedy row's: at temperature 1)."""
    rows = RowSampling.of(sampling, logits.shape[0])
    assert not (isinstance(sampling, Sampling) and sampling.temp == 0), "greedy decoding has no distribution"
    logits = logits.astype(mx.float32) / per_row(rows.temp, logits)
    vocab = logits.shape[-1]
    if rows.top_k is not None:  # k 0 (off) or past the vocabulary: the smallest logit, which masks nothing
        kth = mx.sort(logits, axis=-1)
        index = per_row(mx.where((rows.top_k > 0) & (rows.top_k < vocab), vocab - rows.top_k, 0), logits)
        kth_largest = mx.take_along_axis(kth, mx.broadcast_to(index, (*logits.shape[:-1], 1)), axis=-1)
        logits = mx.where(logits < kth_largest, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if rows.top_p is not None:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (1: all of them).
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        # The most likely token always stays: a top_p that float32 rounds to 0 would otherwise keep nothing.
        most_likely = mx.arange(vocab) == 0
        keep_sorted = (mass_before < per_row(rows.top_p, probs)) | per_row(rows.top_p >= 1, probs) | most_likely
        keep = mx.put_along_axis(mx.zeros(probs.shape, mx.bool_), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


_categorical = mx.vmap(mx.vmap(lambda logits, key: mx.random.categorical(logits, key=key)))
_uniform = mx.vmap(mx.vmap(lambda key: mx.random.uniform(key=key)))


def categorical(log_probs: mx.array, keys: mx.array) -> mx.array:
    """One token from each row of log_probs (B, n, V), each with its key (B, n, 2)."""
    return _categorical(log_probs, keys)


def uniform(keys: mx.array) -> mx.array:
    """A draw from [0, 1) for each key (B, n, 2)."""
    return _uniform(keys)


def sample(logits: mx.array, sampling: "Sampling | RowSampling", positions: mx.array | None = None,
           purpose: int = TOKEN) -> mx.array:
    """One token per row of logits (B, V): the argmax for greedy rows, else a
    draw from the row's distribution with its key for `purpose` at the
    output `positions` (B,) it decides."""
    rows = RowSampling.of(sampling, logits.shape[0])
    greedy = mx.argmax(logits, axis=-1)
    if rows.all_greedy:
        return greedy
    keys = rows.keys_at(positions[:, None], purpose) if rows.keys is not None else None
    if keys is None:  # one Sampling for every row: MLX's global generator
        drawn = mx.random.categorical(mx.log(logits_to_probs(logits, rows)))
    else:
        drawn = categorical(mx.log(logits_to_probs(logits, rows))[:, None], keys)[:, 0]
    return mx.where(rows.is_greedy, greedy, drawn)
