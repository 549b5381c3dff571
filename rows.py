"""A batch's rows: the requests, the rows they take, and the `Batch` every kind of batch builds on.

A `Request` is one prompt's ids and its `Settings` (options.py), and the
statistics its decoding updates. A `Row` is a request's place in a batch:
what it has output, and its clocks. A `Batch` holds the rows decoding
together and their caches: requests join between rounds (their prompts
encoded together, `encode_for`), finished rows leave at once, and each row's
sampling and penalties are the batch's to keep in step with its rows.
decoder.py's and beams.py's batches say what a round does.
"""

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import cpu
import kernels
import mlx.core as mx

from cache import DecoderCache
from model import ROWS_PER_CHUNK, EncoderDecoder, Pieces, drained
from options import Opening, Settings, Stats
from sampling import Penalties, RowPenalties, RowSampling, random_key


# What a request's encoder reads: token ids (a text), or an array of features, (frames, features) (speech), which the
# model's input layer takes (EncoderDecoder.source_input). Its length is len(source) either way.
Source = "list[int] | mx.array"


@dataclass(eq=False)
class Request:
    """One prompt for the engine: its source (token ids, or features), how
    to decode it, and the statistics its decoding updates."""

    source: list[int]  # or an mx.array of features (Source)
    settings: Settings = Settings()
    stats: Stats = field(default_factory=Stats)
    logprobs: list["Logprob"] = field(default_factory=list)  # each output token's, when settings.logprobs asks
    sequences: list[tuple[list[int], float, str]] = field(default_factory=list)  # beams.Search.best: the best beams
    opening: Opening | None = None  # how its decoder opens; None: the model's own (Opening.of)
    rules: tuple = ()  # rules.Rule objects the plan adds to the settings' own (plans.Plan.rules)
    key: tuple[int, int] | None = None  # its random stream (sampling.random_key), once it has one: a replay keeps it
    # Its logprobs from the logits after its rules and penalties (what Whisper's thresholds read, as transformers'
    # and openai-whisper's), not the model's own; and the end of text's, when it ends so (end_logprob).
    ruled_logprobs: bool = False
    end_logprob: float | None = None


# An output token's log-probability, and the most likely tokens' (id, log-probability), most likely first.
Logprob = tuple[float, list[tuple[int, float]]]


Event = tuple[Request, "int | None", "str | None"]  # (request, token or None, finish reason or None)
TOKENS_BLOCK = 64  # Batch.tokens pads the rows' tokens to a multiple of this: the graphs that read them, once a block


def encode_for(models: list[EncoderDecoder], sources: list) -> list[DecoderCache]:
    """Encode sources together into a fresh decoder cache for each model, at once (Encoding)."""
    return Encoding(models, sources).finish()


class Encoding:
    """Sources encoded together (padded on the right and masked, when their
    lengths differ; a source given more than once, once) into a fresh decoder
    cache for each model: at once (finish), the models' work evaluated
    together so that it runs side by side, or a piece at a time (advance),
    so that a long prompt's encoding can take turns with other rows'
    decoding. Token ids pad with the model's pad token, features with zeros.
    The sources' products, of many rows, are computed in cpu.many_rows, apart
    from decoding's few-row ones: the CPU's BLAS wants them done differently."""

    def __init__(self, models: list[EncoderDecoder], sources: list, clocks: tuple = ()):
        tokens = all(isinstance(source, (list, tuple)) for source in sources)
        # a source given n times is encoded once (features: the same array)
        keys = [tuple(source) if tokens else id(source) for source in sources]
        distinct = list(dict.fromkeys(keys))
        rows = [distinct.index(key) for key in keys]
        sources = [sources[keys.index(key)] for key in distinct]
        self.lengths = [len(source) for source in sources]
        self.started = tuple(clock() for clock in clocks or Batch.clocks)  # on the clocks of the batch it joins
        self.caches: list[DecoderCache] | None = None
        self.work = self.pieces(models, sources, tokens, rows if len(sources) < len(rows) else None)
        self.next = None  # the next piece, made (not evaluated) as the last was evaluated
        self.spent = 0.0  # seconds its work has been evaluated for so far

    @property
    def small(self) -> bool:
        """One prompt of one chunk of rows (model.ROWS_PER_CHUNK), or less: never worth evaluating in pieces. (Several
        short prompts together are evaluated in pieces: on a large model their encoding takes as long as a long one's,
        and a short prompt sent meanwhile waits a piece, not all of it.)"""
        return len(self.lengths) == 1 and self.lengths[0] <= ROWS_PER_CHUNK

    def pieces(self, models: list[EncoderDecoder], sources: list, tokens: bool, rows: list[int] | None) -> Pieces:
        """Each model's encoder in pieces, then its cross-attention's keys and values; returns the caches."""
        length = max(self.lengths)
        mask = None
        if any(n < length for n in self.lengths):
            mask = mx.array([[1] * n + [0] * (length - n) for n in self.lengths])
        caches, encoded = [], {}  # id(an encoder) -> its output: a draft that shares its target's reuses it
        for model in models:
            if tokens:
                pad = [model.args.pad_token_id]
                inputs = mx.array([list(source) + pad * (length - n) for source, n in zip(sources, self.lengths)])
            else:
                inputs = mx.stack([mx.pad(mx.array(source), [(0, length - n), (0, 0)])  # (numpy's too: made here)
                                   for source, n in zip(sources, self.lengths)])
            if id(model.encoder) not in encoded:
                encoded[id(model.encoder)] = yield from model.encoding(inputs, mask)
            cache = model.make_cache(encoded[id(model.encoder)], mask)
            if rows is not None:
                cache.keep(rows)
            layers, at_once = cache.cross_keys_values, max(1, len(cpu.lanes()))  # a layer per lane (make_cache)
            for first in range(0, len(layers), at_once):
                yield layers[first : first + at_once]
            caches.append(cache)
        return caches

    def finish(self) -> list[DecoderCache]:
        """The rest of the work, evaluated at once; the caches."""
        if self.caches is None:
            started = time.perf_counter()
            with cpu.many_rows():
                caches = drained(self.work)  # (the next piece, if made, is part of what they compute)
                mx.eval([cache.cross_keys_values for cache in caches])
            self.caches, self.spent = caches, self.spent + time.perf_counter() - started
        return self.caches

    def advance(self, seconds: float, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Evaluate pieces for about `seconds`, or until `interrupted()` (at
        least one; small work all at once); True once the caches are made."""
        if self.small:
            self.finish()
        started = time.perf_counter()
        while self.caches is None:
            try:
                # (made in there too: making a piece may evaluate some of the work, as a cache's rows kept do)
                with cpu.many_rows():
                    piece = self.next if self.next is not None else next(self.work)
                    mx.eval(piece)
                    self.next = next(self.work)  # made now: done is known at once, not a step later
            except StopIteration as done:
                self.caches = done.value
            if time.perf_counter() - started >= seconds or interrupted():
                break
        self.spent += time.perf_counter() - started
        return self.caches is not None


@dataclass(eq=False)
class Row:
    """A request's place in a batch, and where its decoding stands."""

    request: Request
    started: tuple[float, float]  # on its batch's clocks, when it joined
    key: tuple[int, int]  # its random stream (sampling.random_key)
    clocks: tuple[Callable[[], float], ...] = (time.perf_counter, kernels.compiling_seconds)  # its batch's (Batch.clocks)
    produced: int = 0
    output: list[int] = field(default_factory=list)  # the tokens emitted
    forced_end: bool = False  # its model forces the end of text at max_tokens (forced_eos_token_id)
    opening: Opening | None = None  # how its decoder opens: its request's, or its model's (Batch.join)
    last: int = 0  # speculative: the token the target has not seen
    drafting: object = None  # the drafter's own state for the row (beam search: its beams.Search)

    @property
    def settings(self) -> Settings:
        return self.request.settings

    @property
    def stats(self) -> Stats:
        return self.request.stats

    def end(self, tokens: list[int], eos: int | None) -> int | None:
        """Where in tokens the row's output ends: the first EOS or stop token id, if any."""
        stops = self.settings.stop_token_ids
        return next((i for i, token in enumerate(tokens) if token == eos or token in stops), None)

    def emit(self, tokens: list[int], eos: int | None, logprobs: list[Logprob] | None = None) -> Iterator[Event]:
        """Yield an event for each token the row decided, counting it as it
        goes (and keeping its `logprobs`, when the row asks for them); the
        output ends at EOS (itself not output, token None when it came
        first), after a stop token id (output, as vLLM does) or at
        max_tokens. Returns the finish reason, or None while the row goes on."""
        end = self.end(tokens, eos)
        # An end of text the model's config forces at max_tokens ends the output by its length.
        cut = end is not None and self.forced_end and self.produced + end + 1 == self.settings.max_tokens
        if end is not None:
            if tokens[end] == eos and logprobs:
                self.request.end_logprob = logprobs[end][0]
            tokens = tokens[: end + (tokens[end] != eos)]
        self.output += tokens
        if logprobs is not None and (self.settings.logprobs is not None or self.request.ruled_logprobs):
            self.request.logprobs += [(lp, top[: self.settings.logprobs]) for lp, top in logprobs[: len(tokens)]]
        self.timed()  # once: the round decided its tokens together
        for i, token in enumerate(tokens):
            self.produced += 1
            self.stats.generated += 1
            yield self.request, token, self.finish(end is not None, cut) if i == len(tokens) - 1 else None
        if not tokens:
            yield self.request, None, self.finish(True, cut)
        return self.finish(end is not None, cut)

    def timed(self) -> None:
        """Its statistics' seconds, now: since it joined, and of those MLX's compiling (another process's compiles
        at the same time count too: never more than the row's time)."""
        seconds, compiling = (clock() - start for clock, start in zip(self.clocks, self.started))
        self.stats.seconds, self.stats.compiling_seconds = seconds, min(compiling, seconds)

    def finish(self, ended: bool, cut: bool = False) -> str | None:
        if ended:
            return "length" if cut else "stop"
        return "length" if self.produced >= self.settings.max_tokens else None


class Batch:
    """The rows decoding together and their caches (the target's, then any
    the drafter keeps), row i in row i of each. Prompts that join together
    are encoded together: a prompt encoded alone costs up to twice as much
    (`python -m bench batch`)."""

    width = 1  # the caches' rows each request takes (beam search: one a beam)
    # What a row's seconds are read from (Stats): the time, and the time MLX has spent compiling kernels. The tests
    # give it clocks of theirs.
    clocks = (time.perf_counter, kernels.compiling_seconds)

    def __init__(self, models: list[EncoderDecoder], batch_size: int):
        self.models, self.batch_size = models, batch_size
        self.rows: list[Row] = []
        self.caches: list[DecoderCache] = []
        self._sampling = None  # the rows' RowSampling, made again when they change
        self._penalties = None  # (the rows' RowPenalties or None,), made again when they change
        self.counts: mx.array | None = None  # (B, V): each row's output tokens counted, while a row has penalties
        self.encoding_seconds = 0.0  # every join's, all told

    @property
    def free(self) -> int:
        return self.batch_size - len(self.rows)

    def joining(self, waiting: int) -> int:
        """How many of `waiting` prompts to take now: as many as fit, once half
        the batch is free (or all of them fit), so that they encode together."""
        count = min(self.free, waiting)
        return 0 if count == 0 or count < min(waiting, self.batch_size // 2) else count

    def encoding(self, requests: list[Request]) -> Encoding:
        """The encoding of these requests' prompts together, for join, to run at once or in pieces."""
        return Encoding(self.models, [request.source for request in requests], self.clocks)

    def join(self, requests: list[Request], encoding: Encoding | None = None) -> list[Row]:
        """Give these requests rows, their prompts encoded together: by
        `encoding` (self.encoding(requests), finished here if not yet), or now."""
        assert 0 < len(requests) <= self.free
        encoding = encoding or self.encoding(requests)
        caches, started = encoding.finish(), encoding.started
        # The encoding its rows waited for, at once or in pieces between other rows' rounds; a kernel compiled on the
        # way is compiling's.
        seconds, compiling = (clock() - start for clock, start in zip(self.clocks, started))
        encoded = max(seconds - compiling, 0.0)
        forced_end = self.models[0].args.forced_eos_token_id is not None
        for request in requests:
            if request.key is None:
                request.key = random_key(request.settings.seed) if request.settings.temp > 0 else (0, 0)
        model = Opening.of(self.models[0].args)
        rows = [Row(request, started, request.key, self.clocks, forced_end=forced_end, opening=request.opening or model)
                for request in requests]
        self.open(rows, caches[0])
        self.encoding_seconds += encoded
        for request in requests:
            request.stats.prompt_tokens = len(request.source)
            request.stats.encoding_seconds = encoded  # each row waited for the whole join's encoding
        self.joined(rows, caches)
        if self.caches:
            for mine, theirs in zip(self.caches, caches):
                mine.extend(theirs)
        else:
            self.caches = caches
        if self.counts is not None or any(self.row_penalties(row) != Penalties() for row in rows):
            # Rows without penalties count from here on, and never read their counts.
            old = self.counts if self.counts is not None else mx.zeros((len(self.rows) * self.width, self.vocabulary))
            self.counts = mx.concatenate([old, mx.zeros((len(rows) * self.width, self.vocabulary))])
        self.rows += rows
        self._sampling = self._penalties = None
        return rows

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        """What a kind of batch does with rows that join, on their own caches before they merge."""

    def open(self, rows: list[Row], cache: DecoderCache) -> None:
        """Feed the target each joining row's opening but its last token (the
        step that decides the first output token feeds that), padded on the
        right where they differ, the padding's positions trimmed at once."""
        lengths = [len(self.opening(row).start) - 1 for row in rows]
        width = max(lengths)
        if width == 0:
            return
        inputs = [list(self.opening(row).start[:-1]) + [0] * (width - n) for row, n in zip(rows, lengths)]
        mx.eval(self.models[0].decode(mx.array(inputs), cache))
        cache.trim([width - n for n in lengths])

    def leave(self, positions: set[int]) -> list[int]:
        """Drop the rows at these positions; the positions kept."""
        kept = [i for i in range(len(self.rows)) if i not in positions]
        if positions:
            self.rows = [self.rows[i] for i in kept]
            cache_rows = [i * self.width + j for i in kept for j in range(self.width)]
            if kept:
                longest = max(len(row.request.source) for row in self.rows)
                for cache in self.caches:
                    cache.keep(cache_rows, longest)
            else:
                self.caches = []
            self._sampling = self._penalties = None
            penalized = any(self.row_penalties(row) != Penalties() for row in self.rows)
            self.counts = self.counts[mx.array(cache_rows)] if penalized and self.counts is not None else None
        return kept

    def cancel(self, requests: set[Request]) -> None:
        """Drop these requests' rows (a client gone, a stop string found)."""
        self.leave({i for i, row in enumerate(self.rows) if row.request in requests})

    @property
    def sampling(self) -> RowSampling:
        if self._sampling is None:
            self._sampling = RowSampling([row.settings.sampling for row in self.rows], [row.key for row in self.rows])
        return self._sampling

    @property
    def penalties(self) -> RowPenalties | None:
        if self._penalties is None:
            self._penalties = (self.penalties_of(self.rows),)
        return self._penalties[0]

    def penalties_of(self, rows: list[Row]) -> RowPenalties | None:
        """These rows' RowPenalties (one a cache row), None when none has any."""
        args = self.models[0].args
        penalties = [self.row_penalties(row) for row in rows for _ in range(self.width)]
        openings = [self.opening(row).start for row in rows for _ in range(self.width)]
        return RowPenalties.of(penalties, openings, args.eos_token_id, args.vocab_size, args.forced_eos_token_id)

    def opening(self, row: Row) -> Opening:
        """How a row's decoder opens: its request's, or its model's."""
        return row.opening

    def start(self, row: Row) -> int:
        """The token that decides a row's first output token: its opening's last."""
        return self.opening(row).start[-1]

    def row_penalties(self, row: Row) -> Penalties:
        """A row's Penalties, with its opening's forced first token, the end of
        text its model's config forces at max_tokens, and its request's rules."""
        penalties = forced(row.settings, self.models[0].args, self.opening(row).forced)
        return replace(penalties, rules=penalties.rules + row.request.rules) if row.request.rules else penalties

    def tokens(self, rows: list[Row], then: mx.array | None = None) -> mx.array | None:
        """What the rules read on the device (no_repeat_ngram_size, Whisper's
        timestamps), when a row has one: each row's opening and output, then
        `then` (B, n), padded on the left with -1."""
        if self.penalties is None or not self.penalties.needs_tokens:
            return None
        opened = [list(self.opening(row).start) for row in rows]
        # One shape a block, whatever the openings' lengths (a Whisper window's prompt changes from window to window).
        longest = -(-max(len(opening) + len(row.output) for row, opening in zip(rows, opened)) // TOKENS_BLOCK) * TOKENS_BLOCK
        seen = mx.array([[-1] * (longest - len(opening) - len(row.output)) + opening + row.output
                         for row, opening in zip(rows, opened)])
        return seen if then is None else mx.concatenate([seen, then.astype(seen.dtype)], axis=1)

    def history(self, rows: list[Row], then: list[list[int]] | None = None) -> list[list[int]] | None:
        """What rules that read the tokens before them read (RowPenalties.reads_tokens), when a row has one: each
        row's opening and output, then `then`'s tokens, on the host."""
        if self.penalties is None or not self.penalties.reads_tokens:
            return None
        return [list(self.opening(row).start) + row.output + (then[i] if then else []) for i, row in enumerate(rows)]

    @property
    def top_logprobs(self) -> int | None:
        """The most alternatives a row asks logprobs for; None when no row asks for logprobs."""
        asked = [row.settings.logprobs for row in self.rows if row.settings.logprobs is not None]
        return max(asked) if asked else None

    def logprobs_of(self, rows: list[Row], raw: mx.array, ruled: mx.array) -> mx.array:
        """The logits each row's logprobs read: the model's own (raw), or those after its rules (ruled)."""
        asks = [row.request.ruled_logprobs for row in rows]
        if not any(asks) or raw is ruled:
            return raw
        if all(asks):
            return ruled
        return mx.where(mx.array(asks).reshape((-1,) + (1,) * (raw.ndim - 1)), ruled, raw)

    @property
    def vocabulary(self) -> int:
        return self.models[0].args.vocab_size

    def eos(self, row: Row) -> int | None:
        return None if row.settings.ignore_eos else self.models[0].args.eos_token_id

    def round(self) -> Iterator[Event]:
        """One round: every row moves on; yields each new token's event as it
        is counted, and the finished rows leave once all are out."""
        raise NotImplementedError


def forced(settings: Settings, args, first: int | None) -> Penalties:
    """The settings' Penalties with the forced first output token (the row's
    opening's: a target language, or the model's forced_bos_token_id) and
    the end of text the model's config forces as the last
    (forced_eos_token_id), as transformers' generate forces them."""
    penalties = settings.penalties
    if first is not None:
        penalties = replace(penalties, forced_first=first)
    if args.forced_eos_token_id is not None:
        penalties = replace(penalties, forced_end_at=settings.max_tokens - 1)
    return penalties
