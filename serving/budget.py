"""The server's one cache budget (--cache-memory): what the rows it has taken may come to hold, and admission by it.

A row holds, in each decoder layer of each model that decodes it (the
target; the draft too where it drafts), the cross-attention keys and values
of its prompt's positions and the self-attention keys and values of every
position its output can reach: its opening, max_tokens, and the drafts a
round verifies past them. A batch pads every row to its longest prompt and
its furthest reach (cache.py, in blocks of positions), and copies its
caches as rows join, leave or grow, a layer at a time (cache.settle), when
that layer's old storage and new are both alive. So the rows taken hold at most

    rows x (longest prompt + furthest reach) x (a position's bytes in every layer + in one layer)

counted as if they all were one batch (their batches hold no more), a beam
search's self-attention once more (its beams change places every round), a
round's logits besides (each row's verified positions over the vocabulary,
in float32, with the copies sampling makes), and, for each row whose prompt
is being encoded, the encoder's working memory (attention's scores a chunk
of rows at a time: measured as the server starts, encoding_memory; on the
CPU path some 20 MB a head for a 1,024-token prompt). A job is admitted while that,
its rows included, stays within the budget, as if every row ran to
max_tokens: none is ever stopped for room. One that could never fit is
refused before it queues (a 400).

Jobs are admitted in the order they came; one that waits for room may be
passed by later ones that fit, at most PASSES times, after which nothing
passes it until it fits: a small job never waits behind a large one for
long, and a large one is never starved by small ones.
"""

import os
from dataclasses import dataclass

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx

from autodraft import AutoDraft
from cache import DecoderCache, KVCache
from options import AUTO, Opening
from rows import Request

# A round's logits in float32 and what sampling makes of them (log-probabilities, probabilities, a sort and its
# order, their cumulative sum, the masks of top-k and top-p, penalties' counts): a bound, for the target's and the draft's.
LOGIT_COPIES = 8
PASSES = 8  # times a job waiting for room may be passed by later jobs that fit
RESERVED = 0.1  # of the machine's memory, left out of the default budget (server.py): the process, MLX's own pools
ENCODING_MEASURED = 1024  # tokens: from this length on, attention's chunks hold as many scores (encoding_memory)


@dataclass(frozen=True)
class Footprint:
    """What one job's rows may come to hold: how many rows (a beam search's
    beams), its prompt's room and its furthest reach, in cache positions."""

    rows: int
    prompt: int
    reach: int
    verified: int  # positions a round scores for each row (1, or the drafts and the token after them)


class Budget:
    """The bytes the models' caches may hold, and what the jobs taken hold at most: their footprints (`held`), and
    the encoding's working memory for those whose prompts are encoded (`encoding`; an audio job's, throughout:
    each window is encoded in turn)."""

    def __init__(self, models, limit: int, encoding_per_row: int = 0):
        self.models, self.limit, self.encoding_per_row = models, limit, encoding_per_row
        self.vocabulary = models.target.args.vocab_size
        # a position's keys and values in every decoder layer, the target's and the draft's (counted for every row: a
        # bound); read once, here: `used` runs on the metrics' thread, which does not call into MLX
        loaded = [model for model in (models.target, models.draft) if model is not None]
        self.per_position = sum(model.cache_bytes_per_token for model in loaded)
        self.layer_position = max(model.cache_bytes_per_layer for model in loaded)
        self.held: dict[int, Footprint] = {}  # id(job) -> its footprint, while it has rows
        self.encoding: set[int] = set()  # id(job) of those among them being encoded

    def footprint(self, request: Request) -> Footprint:
        settings, args = request.settings, self.models.target.args
        drafts = settings.drafts(self.models)
        longest = AutoDraft.cap if settings.draft_length == AUTO else settings.draft_length
        verified = longest + 1 if drafts else 1
        if args.num_mel_bins:  # a Whisper window: features (the stem halves them), opening and output in its positions
            prompt, reach = -(-len(request.source) // 2), args.max_positions + verified
            return Footprint(settings.num_beams, DecoderCache.room(prompt), -(-reach // KVCache.block) * KVCache.block,
                             verified)
        return text_footprint(len(request.source), settings.max_tokens, verified,
                              len((request.opening or Opening.of(args)).start), settings.num_beams)

    def bytes(self, footprints: list[Footprint], encoded: list[Footprint]) -> int:
        """At most, what rows of these footprints hold together (caches, their copies, a round's logits), the
        `encoded` among them being encoded (held_bytes)."""
        return held_bytes(footprints, self.per_position, self.vocabulary, encoded, self.encoding_per_row,
                          self.layer_position)

    def alone(self, footprint: Footprint) -> int:
        """What a job holds with no other: over the limit, it can never be taken."""
        return self.bytes([footprint], [footprint])

    @property
    def used(self) -> int:
        held = dict(self.held)  # (read from the metrics' thread too)
        return self.bytes(list(held.values()), [held[job] for job in set(self.encoding) & set(held)])

    def fits(self, footprint: Footprint) -> bool:
        held = dict(self.held)
        encoded = [held[job] for job in self.encoding & set(held)] + [footprint]
        return self.bytes([*held.values(), footprint], encoded) <= self.limit

    def room_for(self, jobs: list, free: int) -> tuple[list, list]:
        """(taken, left waiting): in order, the jobs (the engine's, with their request and `passed`) there are rows
        for, `free`, and room for, each taken here; a later job that fits may pass one that waits for room, until
        PASSES have passed it."""
        taken, left, waiting = [], [], None  # waiting: the first job left for want of room
        for job in jobs:
            footprint = self.footprint(job.request)
            if len(taken) < free and (waiting is None or waiting.passed < PASSES) and self.fits(footprint):
                self.take(id(job), footprint)
                taken.append(job)
                if waiting is not None:
                    waiting.passed += 1
            else:
                left.append(job)
                if waiting is None and len(taken) < free:
                    waiting = job
        return taken, left

    def take(self, job_id: int, footprint: Footprint) -> None:
        self.held[job_id] = footprint
        self.encoding.add(job_id)

    def encoded(self, job_id: int, request: Request) -> None:
        """A job's prompt is encoded: its working memory is free (an audio job's window is not its last: kept)."""
        if isinstance(request.source, (list, tuple)):
            self.encoding.discard(job_id)

    def release(self, job_id: int) -> None:
        self.held.pop(job_id, None)
        self.encoding.discard(job_id)


def held_bytes(footprints: list[Footprint], per_position: int, vocabulary: int, encoded: list[Footprint] = (),
               encoding_per_row: int = 0, layer_position: int | None = None) -> int:
    """At most, what rows of these footprints hold together: their caches padded as one batch pads them, and one
    layer's more (`layer_position` a position: as rows join or leave, or room grows, a layer at a time is copied,
    cache.settle; every layer, when it is None), a beam search's self-attention once more (its beams change places
    a round at a time, each layer's copy made as the round runs), a round's logits, and the working memory of the
    `encoded` among them (it grows with their prompts past the length it was measured at)."""
    if not footprints:
        return 0
    rows = sum(footprint.rows for footprint in footprints)
    positions = max(footprint.prompt for footprint in footprints) + max(footprint.reach for footprint in footprints)
    copied = per_position if layer_position is None else layer_position
    beams = sum(footprint.rows * footprint.reach for footprint in footprints if footprint.rows > 1) * per_position
    logits = sum(footprint.rows * footprint.verified for footprint in footprints) * vocabulary * 4 * LOGIT_COPIES
    encoding = sum(footprint.rows * encoding_per_row * max(1.0, footprint.prompt / ENCODING_MEASURED)
                   for footprint in encoded)
    return rows * positions * (per_position + copied) + beams + logits + int(encoding)


def text_footprint(prompt: int, max_tokens: int, verified: int = 1, opening: int = 1, rows: int = 1) -> Footprint:
    """A text request's footprint (Budget.footprint's rule, from its numbers alone)."""
    reach = opening + max_tokens + verified
    return Footprint(rows, DecoderCache.room(prompt), -(-reach // KVCache.block) * KVCache.block, verified)


def encoding_memory(models, length: int) -> int:
    """What encoding one row takes beyond its caches, at most: measured on a prompt of `length` tokens (a Whisper's
    window of silence), encoded as the engine encodes, a piece at a time. Attention's scores are computed in blocks
    bounded by attention.SCORES_PER_BLOCK, which a longer prompt does not pass (up to 8,192 tokens, where the
    blocks reach their fewest rows); the rest (its hidden states, keys and values) grows with it (Budget.bytes)."""
    import numpy as np

    from rows import Encoding

    args = models.target.args
    from speech_tokens import window_frames

    source = np.zeros((window_frames(models.target), args.num_mel_bins), np.float32) if args.num_mel_bins \
        else [args.pad_token_id + 1] * length
    models = [model for model in (models.target, models.draft) if model is not None]
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    encoding = Encoding(models, [source])
    while not encoding.advance(60.0):
        pass
    caches = sum(keys.nbytes + values.nbytes for cache in encoding.caches for keys, values in cache.cross_keys_values)
    return max(0, mx.get_peak_memory() - before - caches)


def machine_memory() -> int:
    """The memory the models may use: the GPU's recommended working set where MLX gives one (a Mac's Metal), else
    the machine's physical memory."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(models) -> int:
    """The models' weights, as loaded (an array a draft borrows from its target counted once)."""
    from mlx.utils import tree_flatten

    arrays = {id(array): array for model in (models.target, models.draft) if model is not None
              for _, array in tree_flatten(model.parameters())}
    return sum(array.nbytes for array in arrays.values())
