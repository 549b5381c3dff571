"""Beam search with the target alone: many prompts' beams in one batch, each answer transformers' generate(num_beams=...).

A `BeamBatch` is a rows.Batch whose rows take `num_beams` rows of the
caches each. A round is one step of every prompt's search:

1. the model scores each beam's last token; its log-softmax, after the
   row's processors (as transformers applies them to beams: to the
   log-probabilities), is added to the beam's score;
2. the 2 x num_beams best continuations of each prompt over all its beams
   and tokens come back to the host, where `Search.step` keeps the best
   num_beams that did not end as the running beams, and the best finished
   ones, each scored by its log-probability over its length to the power
   length_penalty;
3. the caches' rows follow the beams they continue (self-attention only:
   every beam of a prompt shares its encoding).

A prompt's search ends as transformers' does: once every continuation ends
(at max_tokens), once num_beams beams finished with early_stopping true, or
else once no running beam can beat the worst finished one (early_stopping
false guesses at the current length, "never" at max_tokens when the length
penalty is positive). Its best sequence is the row's output; the
num_return_sequences best, with their scores and finish reasons, are in
Request.sequences.
"""

from dataclasses import dataclass, field

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx
import numpy as np

from rows import TOKENS_BLOCK, Batch, Row
from cache import DecoderCache
from model import EncoderDecoder
from sampling import one_hot

NONE = np.float32(-1e9)  # transformers' score for a slot with no beam: the sum of a beam's log-probabilities never gets there


@dataclass
class Search:
    """One prompt's search: its running beams (tokens after the start token)
    and their scores, and its best finished beams (num_beams slots, the empty
    ones scored NONE), as transformers' _beam_search keeps them."""

    beams: int
    running: list[list[int]] = field(default_factory=list)
    scores: np.ndarray = None  # (beams,) float32
    # (score, tokens, a real beam, its tokens' log-probabilities after the rules, renormalised: with `ruled`)
    finished: list[tuple[np.float32, list[int], bool, list[float]]] = field(default_factory=list)
    ruled: list[list[float]] = field(default_factory=list)  # each running beam's, as finished keeps them
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    def __post_init__(self):
        self.running, self.ruled = [[] for _ in range(self.beams)], [[] for _ in range(self.beams)]
        self.scores = np.array([0.0] + [NONE] * (self.beams - 1), np.float32)  # one beam until the first step
        self.finished = [(NONE, [], False, [])] * self.beams

    def step(self, scores, beams, tokens, ends: set[int], max_tokens: int, length_penalty: float, early_stopping,
             ruled=None) -> list[int]:
        """Take a step's 2 x num_beams best continuations (score, the beam
        each continues, its token, and with `ruled` its log-probability after
        the rules, renormalised; best first); return the beam each new
        running beam continues."""
        generated = len(self.running[0]) + 1  # after this step
        candidates = [self.running[b] + [t] for b, t in zip(beams, tokens)]
        picked = [self.ruled[b] + [float(ruled[i])] if ruled is not None else [] for i, b in enumerate(beams)]
        hit = np.array([t in ends or generated >= max_tokens for t in tokens])
        # The running beams: the best continuations that did not end.
        running = scores + np.where(hit, NONE, np.float32(0))
        order = np.argsort(-running, kind="stable")[: self.beams]
        self.running, self.scores = [candidates[i] for i in order], running[order]
        self.ruled = [picked[i] for i in order]
        # The finished: of the num_beams best continuations, those that ended, if they beat the worst finished.
        normalised = (scores / np.float32(generated ** length_penalty)).astype(np.float32)
        full = all(real for _, _, real, _ in self.finished) and early_stopping is True
        closed = full or not self.improvable
        new = [(normalised[i] + (NONE if closed else 0), candidates[i], True, picked[i])
               if i < self.beams and hit[i] else (normalised[i] + NONE, candidates[i], False, picked[i])
               for i in range(len(tokens))]
        merged = self.finished + new
        best = np.argsort(-np.array([score for score, _, _, _ in merged], np.float32), kind="stable")[: self.beams]
        self.finished = [merged[i] for i in best]
        # Whether a running beam may still beat the worst finished one.
        length = max_tokens if early_stopping == "never" and length_penalty > 0 else generated
        hoped = self.scores[0] / np.float32(length ** length_penalty)
        worst = min(score for score, _, _, _ in self.finished)
        self.improvable = self.improvable and any(hoped > (worst if real else NONE) for _, _, real, _ in self.finished)
        full = all(real for _, _, real, _ in self.finished) and early_stopping is True
        self.done = not self.improvable or full or hit.all()
        return [beams[i] for i in order]

    def best(self, count: int, ends: set[int], eos: int | None) -> list[tuple[list[int], float, str]]:
        """The count best finished beams, best first: tokens (without a last
        EOS), score, and why each ended: "stop" (an end token) or "length"."""
        return [(tokens[:-1] if tokens[-1] == eos else tokens, float(score), "stop" if tokens[-1] in ends else "length")
                for score, tokens, _, _ in self.finished[:count]]


class BeamBatch(Batch):
    """Rows that search with `num_beams` beams each, in one batch."""

    def __init__(self, model: EncoderDecoder, batch_size: int, num_beams: int):
        super().__init__([model], batch_size)
        self.model, self.width = model, num_beams

    def joined(self, rows: list[Row], caches: list[DecoderCache]) -> None:
        for row in rows:
            row.drafting = Search(self.width)
        for cache in caches:  # each prompt's row, once a beam
            cache.keep([i for i in range(len(rows)) for _ in range(self.width)])

    def round(self):
        rows, K, V = self.rows, self.width, self.vocabulary
        searches = [row.drafting for row in rows]
        last = mx.array([[beam[-1] if beam else self.start(row)] for row, search in zip(rows, searches)
                         for beam in search.running])
        logits = self.model.decode(last, self.caches[0])[:, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.penalties is not None:  # on the log-probabilities, as transformers' beam search applies processors
            positions = mx.array([len(beam) for search in searches for beam in search.running])
            history = None
            if self.penalties.reads_tokens:
                history = [list(self.opening(row).start) + beam for row, search in zip(rows, searches) for beam in search.running]
            logprobs = self.penalties.apply(logprobs[:, None], self.counts[:, None], positions[:, None],
                                            self.beam_tokens(rows, searches), history)[:, 0]
        ruled = None  # Whisper's windows: the tokens' log-probabilities after the rules, renormalised, as its guards read them
        if any(row.request.ruled_logprobs for row in rows):
            ruled = (logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)).reshape(len(rows), K * V)
        totals = (logprobs.reshape(len(rows), K, V) + mx.array(np.stack([s.scores for s in searches]))[..., None])
        totals = totals.reshape(len(rows), K * V)
        top = mx.argpartition(-totals, 2 * K - 1, axis=-1)[:, : 2 * K]
        values = mx.take_along_axis(totals, top, axis=-1)
        order = mx.argsort(-values, axis=-1)
        top, values = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
        if ruled is not None:
            ruled = np.array(mx.take_along_axis(ruled, top, axis=-1))
        top, values = np.array(top), np.array(values)
        sources, finished, ends = [], set(), [self.ends(row) for row in rows]
        for r, (row, search) in enumerate(zip(rows, searches)):
            row.stats.target_calls += 1
            continued = search.step(values[r], (top[r] // V).tolist(), (top[r] % V).tolist(), ends[r], row.settings.max_tokens,
                                    row.settings.length_penalty, row.settings.early_stopping,
                                    None if ruled is None else ruled[r])
            sources += [r * K + int(b) for b in continued]
        if sources != list(range(len(sources))):  # a beam left its place
            self.caches[0].reorder(sources)
        if self.counts is not None:
            new = mx.array([beam[-1] for search in searches for beam in search.running])
            self.counts = self.counts[mx.array(sources)] + one_hot(new, V)
        for position, (row, search) in enumerate(zip(rows, searches)):
            if search.done:  # the best beam's tokens (its EOS too, which emit leaves out of the output)
                row.request.sequences = search.best(row.settings.num_return_sequences, ends[position], self.eos(row))
                _, tokens, _, picked = search.finished[0]
                yield from row.emit(tokens, self.eos(row), [(logprob, []) for logprob in picked] or None)
                finished.add(position)
        self.leave(finished)

    def ends(self, row: Row) -> set[int]:
        eos = self.eos(row)
        return set(row.settings.stop_token_ids) | ({eos} if eos is not None else set())

    def beam_tokens(self, rows: list[Row], searches: list[Search]) -> mx.array | None:
        """Each beam's opening and tokens, padded on the left with -1, for no_repeat_ngram_size and Whisper's timestamps."""
        if not self.penalties.needs_tokens:
            return None
        opened = [list(self.opening(row).start) for row in rows]
        longest = -(-max(len(opening) + len(search.running[0]) for opening, search in zip(opened, searches))
                    // TOKENS_BLOCK) * TOKENS_BLOCK  # one shape a block, whatever the openings' lengths
        return mx.array([[-1] * (longest - len(opening) - len(beam)) + opening + beam
                         for row, opening, search in zip(rows, opened, searches) for beam in search.running])
