"""Decoding state, as explicit objects: each decoder layer's self-attention keys and values (`KVCache`), and a
batch's whole decoder state (`DecoderCache`: those, and the cross-attention keys and values computed once a prompt).

Storage grows in blocks of positions, so that a decode step's shapes (and the
compiled graph that runs it) change once a block, not every token; rows keep
their own lengths, trim their own rejected drafts, and leave or join a batch
between rounds.
"""

import cpu  # noqa: F401  (before mlx.core: picks a fast BLAS on Linux)
import mlx.core as mx


def write(storage: mx.array, positions: mx.array, new: mx.array) -> mx.array:
    """storage (B, H, capacity, D) with new (B, H, L, D) put at each row's positions (B, L)."""
    return mx.put_along_axis(storage, positions[:, None, :, None], new, axis=2)


class KVCache:
    """One layer's self-attention keys/values for a batch, in storage
    preallocated in blocks of positions, so that a step's shapes change once
    a block, not every token (decode steps are compiled for their shapes).
    Each row has its own length (`offsets`): the rows of a speculative batch
    accept different numbers of drafts. Positions past a row's length are
    stale or empty, and masked. `trim` forgets a row's last positions
    (rejected drafts); the next step overwrites them."""

    # Every query reads the whole storage, so a block's unused tail is read
    # every step; each new size compiles a new graph. 64 weighs the two.
    block = 64

    def __init__(self, rows: int = 1):
        self.keys = None
        self.values = None
        self.offsets = [0] * rows

    @property
    def offset(self) -> int:
        assert len(set(self.offsets)) == 1, "rows of different lengths have no one offset"
        return self.offsets[0]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, length: int, heads: int, dim: int, dtype) -> None:
        """Room for `length` more positions in every row, grown a block at a time."""
        end = max(self.offsets) + length
        if end > self.capacity:
            shape = (len(self.offsets), heads, -(-end // self.block) * self.block, dim)
            self.keys, self.values = (self._resized(old, shape, dtype) for old in (self.keys, self.values))
            settle(self.keys, self.values)

    def advance(self, length: int, keys: mx.array, values: mx.array) -> None:
        """Take the storage a step wrote `length` new positions of every row into."""
        self.keys, self.values = keys, values
        self.offsets = [offset + length for offset in self.offsets]

    def _resized(self, old, shape, dtype) -> mx.array:
        new = mx.zeros(shape, dtype)
        if old is not None:
            kept = min(old.shape[2], shape[2])
            new[..., :kept, :] = old[..., :kept, :]
        return new

    def trim(self, n: int | list[int]) -> None:
        """Forget the last n positions of every row, or n[b] of row b."""
        trims = n if isinstance(n, list) else [n] * len(self.offsets)
        assert all(0 <= t <= o for t, o in zip(trims, self.offsets)), (trims, self.offsets)
        self.offsets = [o - t for o, t in zip(self.offsets, trims)]

    def keep(self, rows: list[int]) -> None:
        """Only these rows, in this order (finished rows leave a batch), in
        storage cut to the block-rounded length of the longest of them: every
        step reads all of it, and a long row that left would leave it long
        (the next reserve may grow it again: one copy as a row leaves)."""
        self.offsets = [self.offsets[row] for row in rows]
        if self.keys is not None:
            room = -(-max(self.offsets, default=0) // self.block) * self.block
            index = mx.array(rows, dtype=mx.int32)
            self.keys, self.values = (stored[index, :, :room] for stored in (self.keys, self.values))

    def extend(self, other: "KVCache") -> None:
        """Append other's rows after these (prompts joining a batch)."""
        stored = [cache for cache in (self, other) if cache.keys is not None]
        if stored:
            B, H, capacity, D = max((cache.keys.shape for cache in stored), key=lambda shape: shape[2])
            dtype = stored[0].keys.dtype

            def rows_of(cache, arrays):  # every row's storage at the common capacity
                if cache.keys is None:
                    return mx.zeros((len(cache.offsets), H, capacity, D), dtype)
                return arrays if arrays.shape[2] == capacity else self._resized(arrays, (arrays.shape[0], H, capacity, D), dtype)

            self.keys = mx.concatenate([rows_of(self, self.keys), rows_of(other, other.keys)])
            self.values = mx.concatenate([rows_of(self, self.values), rows_of(other, other.values)])
            other.keys = other.values = None  # (other's rows are these now)
            settle(self.keys, self.values)
        self.offsets = self.offsets + other.offsets


class DecoderCache:
    """Everything the decoder keeps between steps for a batch of prompts:
    each layer's self-attention cache, and the cross-attention keys/values
    and encoder padding bias, computed once per prompt."""

    # Every step reads the padding too (at most 31 positions a row, 1.5 MB each
    # in T5-11B at 16 bits: 1.5% of a 4-bit decoder's bytes for one row), and each
    # new length compiles new graphs, one for every draft count a round may
    # verify (num-draft auto's eight among them).
    prompt_block = 32

    @classmethod
    def room(cls, prompt_length: int) -> int:
        """The positions a prompt of this length takes in the cache."""
        return -(-prompt_length // cls.prompt_block) * cls.prompt_block

    def __init__(self, cross_keys_values: list, cross_bias: mx.array | None):
        rows = cross_keys_values[0][0].shape[0]
        self.self_attention = [KVCache(rows) for _ in cross_keys_values]
        self.cross_keys_values = list(cross_keys_values)  # (replaced a layer at a time: settle)
        self.cross_bias = cross_bias  # encoder padding mask (B, 1, 1, S); make_cache always gives one

    @property
    def offsets(self) -> list[int]:
        return self.self_attention[0].offsets

    @property
    def offset(self) -> int:
        return self.self_attention[0].offset

    def trim(self, n: int | list[int]) -> None:
        for cache in self.self_attention:
            cache.trim(n)

    def reserve(self, length: int) -> tuple[list[mx.array], list[mx.array]]:
        """Every layer's storage, with room for `length` more positions."""
        _, heads, _, dim = self.cross_keys_values[0][0].shape
        for cache in self.self_attention:
            cache.reserve(length, heads, dim, self.cross_keys_values[0][0].dtype)
        return [cache.keys for cache in self.self_attention], [cache.values for cache in self.self_attention]

    def advance(self, length: int, keys: list[mx.array], values: list[mx.array]) -> None:
        for cache, k, v in zip(self.self_attention, keys, values):
            cache.advance(length, k, v)

    def keep(self, rows: list[int], cross_length: int | None = None) -> None:
        """Only these rows, in this order; cross-attention cut to the room
        of a cross_length prompt if given (the longest prompt left is shorter)."""
        index = mx.array(rows)
        for cache in self.self_attention:
            cache.keep(rows)
            settle(cache.keys, cache.values)
        cut = slice(None, None if cross_length is None else self.room(cross_length))
        for layer, (k, v) in enumerate(self.cross_keys_values):
            self.cross_keys_values[layer] = (k[index, :, cut], v[index, :, cut])
            settle(*self.cross_keys_values[layer])
        if self.cross_bias is not None:
            self.cross_bias = self.cross_bias[index, ..., cut]

    def row(self, row: int) -> "DecoderCache":
        """A cache of one row's cross-attention alone (its keys, values and bias; no positions of its own): what a
        pass over that row's tokens attends to (speech_tokens.token_times, as the row ends)."""
        return DecoderCache([(k[row : row + 1], v[row : row + 1]) for k, v in self.cross_keys_values],
                            None if self.cross_bias is None else self.cross_bias[row : row + 1])

    def reorder(self, rows: list[int]) -> None:
        """The self-attention caches of these rows, in this order, rows
        repeated or dropped (beam search's beams, each the continuation of a
        beam of the same prompt, whose cross-attention is the same)."""
        for cache in self.self_attention:
            cache.keep(rows)

    def extend(self, other: "DecoderCache") -> None:
        """Append other's rows (prompts encoded apart) after these. The
        shorter prompts' cross-attention keys are padded, and the padding masked."""
        length = max(cache.cross_keys_values[0][0].shape[2] for cache in (self, other))
        if self.cross_bias is not None or other.cross_bias is not None or \
                self.cross_keys_values[0][0].shape[2] != other.cross_keys_values[0][0].shape[2]:
            self.cross_bias = mx.concatenate([self.cross_bias_over(length), other.cross_bias_over(length)])
        for layer, (mine, theirs) in enumerate(zip(self.cross_keys_values, other.cross_keys_values)):
            self.cross_keys_values[layer] = tuple(mx.concatenate([pad_length(a, length), pad_length(b, length)])
                                                  for a, b in zip(mine, theirs))
            other.cross_keys_values[layer] = None  # (other's rows are these now)
            settle(*self.cross_keys_values[layer])
        for mine, theirs in zip(self.self_attention, other.self_attention):
            mine.extend(theirs)

    def cross_bias_over(self, length: int) -> mx.array:
        """The cross-attention bias (B, 1, 1, length): -inf at padding and past each prompt's end."""
        rows, _, own, _ = self.cross_keys_values[0][0].shape
        dtype = self.cross_keys_values[0][0].dtype
        bias = mx.zeros((rows, 1, 1, own), dtype) if self.cross_bias is None else self.cross_bias
        return mx.concatenate([bias, mx.full((rows, 1, 1, length - own), -mx.inf, dtype)], axis=-1)


def settle(*arrays) -> None:
    """Compute a layer's new storage now, as rows join or leave a batch or its room grows: the layer's old storage
    is freed before the next layer's is made, so that the copy holds one layer twice at most, not every layer
    (which a whole step's graph, evaluated at once, holds: 2x the cache for a moment). serving/budget.py counts
    on it."""
    arrays = [array for array in arrays if array is not None]
    if arrays:
        mx.eval(*arrays)


def pad_length(x: mx.array, length: int) -> mx.array:
    """(B, H, S, D) keys or values with zeros after position S up to length."""
    missing = length - x.shape[2]
    return x if missing == 0 else mx.pad(x, [(0, 0), (0, 0), (0, missing), (0, 0)])
