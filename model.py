"""The T5 encoder-decoder in MLX, with the caches incremental decoding needs.

One module per piece of the paper: relative position bias, attention, the
feed-forward block, encoder and decoder layers. Covers every public T5 flavour:
v1.0 (ReLU, head tied to the embedding and scaled by d_model**-0.5) and
v1.1 / FLAN-T5 / mT5 (gated GELU, separate head, no scaling).

Decoding state is explicit: `DecoderCache` holds, per decoder layer, a growing
self-attention `KVCache` (trimmable, for speculative rollback) and the
cross-attention keys/values computed once from the encoder output.

`load` finds converted models by name and reads them with their tokenizer.
"""

import contextlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

import cpu  # must precede mlx.core: picks a fast BLAS on Linux
import mlx.core as mx
import mlx.nn as nn

FORMAT_KEY = "mlx_conversion"  # marks a config.json written by convert.py


@dataclass
class ModelArgs:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_heads: int
    num_layers: int
    num_decoder_layers: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True  # no separate lm_head: the embedding is the head
    scale_decoder_outputs: bool = True  # v1.0 scales the head input by d_model**-0.5
    decoder_start_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        names = {f.name for f in fields(cls)}
        args = {k: v for k, v in config.items() if k in names and v is not None}
        args.setdefault("num_decoder_layers", config["num_layers"])
        return cls(**args)


_ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": nn.gelu,  # exact (erf) GELU, as Hugging Face's "gelu"
    "gelu_new": nn.gelu_approx,  # tanh approximation
    "gelu_pytorch_tanh": nn.gelu_approx,
    "silu": nn.silu,
}


class RelativePositionBias(nn.Module):
    """Learned per-head bias indexed by log-spaced buckets of key - query distance."""

    def __init__(self, args: ModelArgs, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = args.relative_attention_num_buckets
        self.max_distance = args.relative_attention_max_distance
        self.embeddings = nn.Embedding(self.num_buckets, args.num_heads)

    def bucket(self, relative_position: mx.array) -> mx.array:
        num_buckets = self.num_buckets
        bucket = mx.zeros_like(relative_position)
        if self.bidirectional:
            num_buckets //= 2
            bucket = (relative_position > 0).astype(mx.int32) * num_buckets
            distance = mx.abs(relative_position)
        else:
            distance = mx.maximum(-relative_position, 0)
        max_exact = num_buckets // 2
        # Same float32 operation order as the reference, so bucket edges agree.
        log_ratio = mx.log(distance.astype(mx.float32) / max_exact)
        scaled = log_ratio / math.log(self.max_distance / max_exact) * (num_buckets - max_exact)
        far = mx.minimum(max_exact + scaled.astype(mx.int32), num_buckets - 1)
        return bucket + mx.where(distance < max_exact, distance, far)

    def __call__(self, queries: mx.array, key_length: int) -> mx.array:
        """Bias (B, heads, L, key_length) for the query positions (B, L):
        each row of a batch at its own positions."""
        distance = mx.arange(key_length) - queries[..., None]
        return self.embeddings(self.bucket(distance)).transpose(0, 3, 1, 2)

    def by_distance(self, length: int) -> mx.array:
        """(2 * length - 1, heads): the bias of each key - query distance, -(length - 1) first.
        A length-L input's whole (L, L) bias is made of these 2L - 1 rows."""
        return self.embeddings(self.bucket(mx.arange(1 - length, length)))


def bias_rows(by_distance: mx.array, first: int, last: int, length: int) -> mx.array:
    """Rows first..last-1 of a length-long bias, (1, heads, last - first, length),
    as a view of the distance table: row i, column j is its entry j - i."""
    heads = by_distance.shape[1]
    return mx.as_strided(by_distance, (1, heads, last - first, length), (0, 1, -heads, heads), (length - 1 - first) * heads)


# Long inputs are encoded piecewise, at two grains. Projections and the FFN
# take chunks of rows: big enough for the BLAS to run near its peak, and at
# least one per lane (core). Attention takes smaller blocks, of queries and of
# heads, whose scores (8 MB of float32) are reused memory, not pages fresh
# from the OS (cpu.py), and which keep at least 32 queries, below which the
# products run at half speed. MLX evaluates up to ~20 independent blocks side
# by side, so this also sets the memory attention takes whatever the length
# (~0.5 GB; 4 MB blocks halve that and run 20-30% slower: bench.py encode).
ROWS_PER_CHUNK = 512
SCORES_PER_BLOCK = 1 << 21
ROWS_PER_BLOCK = 32  # at least
OWN_SOFTMAX_FROM = 4096  # scores per query (heads x keys) from which cross-attention takes our softmax; see attend


def row_chunks(length: int, lanes: int) -> list[tuple[int, int]]:
    """Chunks of at most ROWS_PER_CHUNK rows, one per lane at least."""
    size = min(ROWS_PER_CHUNK, -(-length // max(1, lanes)))
    return [(first, min(first + size, length)) for first in range(0, length, size)]


def attention_blocks(first: int, last: int, heads: int, keys: int) -> list[tuple[int, int, int, int]]:
    """(first row, last row, first head, last head) blocks covering rows
    first..last-1 and every head, each with at most SCORES_PER_BLOCK scores
    (or ROWS_PER_BLOCK rows of one head, when a row alone has more)."""
    rows = min(last - first, max(ROWS_PER_BLOCK, SCORES_PER_BLOCK // (heads * keys)))
    group = max(1, min(heads, SCORES_PER_BLOCK // (rows * keys)))
    return [(a, min(a + rows, last), h, min(h + group, heads))
            for a in range(first, last, rows) for h in range(0, heads, group)]


def lane(lanes: tuple, i: int):
    """Where block i's work runs: the lanes (streams) in turn, or the default stream."""
    return mx.stream(lanes[i % len(lanes)]) if lanes else contextlib.nullcontext()


def from_lane(lanes: tuple, i: int) -> tuple:
    """The lanes in the same turn, starting from lane i: a chunk's blocks
    start on the chunk's own lane, so that chunks of a single block still
    spread over the cores."""
    return lanes[i % len(lanes):] + lanes[:i % len(lanes)] if lanes else lanes


# 2**f for f in [-0.5, 0.5]: its Taylor series to degree 6 (error below 2e-7).
_EXP2_TERMS = [math.log(2) ** k / math.factorial(k) for k in range(7)]

# exp(x) for x <= 0 is 2**y, y = x / ln 2: 2**n * 2**f, n the integer nearest
# y and f = y - n in [-0.5, 0.5]; 2**n is put into a float's exponent bits and
# 2**f is a polynomial. MLX's CPU compile fuses elementwise operations into
# one C++ loop, but cuts the graph at a bit cast (view) and 11 operations
# deep, and every cut is another pass over memory; a scalar at a cut also
# turns the loop into an indexing one. So the work is two compiled halves,
# each at most 10 operations deep, with the bit cast between: ~1.4 ns a
# score, where the same work as one compiled function (cut into 5 loops)
# took ~2.4 and MLX's exp takes ~9 (bench.py attention, x86). No floor:
# built without SSE4.1 it is a library call per element; a cast to integer
# truncates, toward 0. Not shapeless: MLX's shapeless tracing adds
# broadcasts that cut the graph again.


def _scaled_and_exponent_bits(x: mx.array) -> tuple[mx.array, mx.array]:
    """y = x / ln 2, and the float bits of 2**n; below x = -87 (where float32
    runs out of exponents) the bits of 0, as MLX's exp gives. In float32
    whatever x's type: half precision would lose digits in y."""
    y = mx.maximum(x.astype(mx.float32), -87.0) * (1 / math.log(2))
    n = (y - 0.5).astype(mx.int32)  # the integer nearest y (y <= 0: the cast rounds toward zero)
    return y, mx.where(x >= -87.0, (n + 127) << 23, 0)


def _times_exp2_fraction(y: mx.array, power_of_two: mx.array) -> mx.array:
    """2**n * 2**f, the polynomial in Estrin's order (shallower than Horner's,
    so that the whole half fuses)."""
    f = y - (y - 0.5).astype(mx.int32).astype(y.dtype)
    f2 = f * f
    c = _EXP2_TERMS
    return (c[0] + c[1] * f + f2 * (c[2] + c[3] * f) + (f2 * f2) * (c[4] + c[5] * f + f2 * c[6])) * power_of_two


# Without a C++ compiler (MLX's CPU compile runs g++), MLX evaluates them op by op.
_compiled_halves = (mx.compile(_scaled_and_exponent_bits), mx.compile(_times_exp2_fraction))


def _exp_below_zero(x: mx.array) -> mx.array:
    first, second = _compiled_halves
    y, bits = first(x)
    return second(y, bits.view(mx.float32)).astype(x.dtype)  # half stays half


@mx.custom_function
def exp_below_zero(x: mx.array) -> mx.array:
    """_exp_below_zero with exp's gradient: its bit cast has none, and
    training runs the encoder's attention through it."""
    return _exp_below_zero(x)


@exp_below_zero.vjp
def _exp_below_zero_vjp(primals, cotangent, output):
    return cotangent * output


def with_summing_column(values: mx.array) -> mx.array:
    """values (..., keys, d) with a column of ones appended: the weights'
    product with them is then the weighted values and, in the last column,
    the weights' sum, in one product (a sum of its own costs ~1 ns a score)."""
    return mx.concatenate([values, mx.ones((*values.shape[:-1], 1), values.dtype)], axis=-1)


def attend(queries: mx.array, keys: mx.array, values: mx.array, bias: mx.array | None, softmax: str = "by-keys",
           summing_column: bool = False) -> mx.array:
    """Softmax attention with an additive bias, scale 1 (T5 folds 1/sqrt(d_kv)
    into its initialisation). On a GPU, the fused kernel. On the CPU, where
    MLX's fused attention is built of plain operations anyway, our own: the
    bias added in the scores' product, and no scaling by 1, two operations
    fewer, which matters in a narrow model's decode step. The softmax is
    MLX's (`softmax="mlx"`) or ours (`"ours"`): an exponential of our own,
    a whole block ~6 ns a score where MLX's fused attention costs ~13 on x86
    (bench.py attention), in a few operations more, which pay once a call
    has tens of queries. So the encoder, whose queries are its whole
    prompt, takes ours; the decoder's self-attention takes MLX's (its keys
    grow step by step: a rule on their count would switch in a verify pass
    at a different step than in a regular one); and cross-attention (`"by-keys"`) takes ours when each
    query scores OWN_SOFTMAX_FROM keys x heads or more (a long prompt), a rule
    on each query's own scores, never on how many queries come, so a row gets
    the same arithmetic alone or in a verify pass. With `summing_column`
    (our softmax only) the values end in a column of ones
    (with_summing_column), which gives the normaliser."""
    B, H, L, _ = queries.shape
    if mx.default_device() != mx.cpu:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=bias)
    transposed = keys.swapaxes(-1, -2)
    scores = queries @ transposed if bias is None else mx.addmm(bias, queries, transposed)
    if softmax == "mlx" or (softmax == "by-keys" and H * keys.shape[2] < OWN_SOFTMAX_FROM):
        return mx.softmax(scores, axis=-1, precise=True) @ values
    weights = exp_below_zero(scores - scores.max(axis=-1, keepdims=True))
    if summing_column:
        out = weights @ values
        return out[..., :-1] / out[..., -1:]
    return (weights @ values) / weights.sum(axis=-1, keepdims=True)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_heads
        inner = args.num_heads * args.d_kv
        self.q = nn.Linear(args.d_model, inner, bias=False)
        self.k = nn.Linear(args.d_model, inner, bias=False)
        self.v = nn.Linear(args.d_model, inner, bias=False)
        self.o = nn.Linear(inner, args.d_model, bias=False)

    def split_heads(self, x: mx.array, rows: int | None = None) -> mx.array:
        """(B, L, inner), or (B * L, inner) given rows=B -> (B, heads, L, d_kv)."""
        return x.reshape(rows or x.shape[0], -1, self.num_heads, x.shape[-1] // self.num_heads).transpose(0, 2, 1, 3)

    def project_keys_values(self, x: mx.array, rows: int | None = None) -> tuple[mx.array, mx.array]:
        return self.split_heads(self.k(x), rows), self.split_heads(self.v(x), rows)

    def __call__(self, x: mx.array, keys_values: tuple[mx.array, mx.array], bias: mx.array | None,
                 softmax: str = "by-keys") -> mx.array:
        """x's queries over keys_values: the decoder's cached self-attention
        (with MLX's softmax, see attend) or the prompt's cross-attention. x is (B * L,
        d_model): the decoder keeps its states as a matrix, whose products
        need no reshaping around them."""
        out = attend(self.split_heads(self.q(x), keys_values[0].shape[0]), *keys_values, bias, softmax)
        return self.o(out.transpose(0, 2, 1, 3).reshape(x.shape[0], -1))

    def attend_in_blocks(self, x: mx.array, first: int, bias_of, keys_values: tuple[mx.array, mx.array],
                         lanes: tuple = ()) -> mx.array:
        """Self-attention of the rows of a long input that start at `first`
        (x holds just those), over all its keys and values, in blocks of
        queries and heads. bias_of(a, b): the attention bias of rows a..b-1.
        The blocks take the lanes in turn: MLX runs a graph's operations in
        about the order they were built, a bounded number ahead, so a chunk
        whose blocks all ran on one lane would keep the others idle."""
        B, L, _ = x.shape
        last = first + L
        queries = self.split_heads(self.q(x))
        keys, values = keys_values
        summing = values.shape[-1] == queries.shape[-1] + 1  # EncoderLayer appended a summing column (on the CPU)
        blocks = {}  # first row -> that block's output, head group by head group
        for i, (a, b, h, g) in enumerate(attention_blocks(first, last, self.num_heads, keys.shape[2])):
            with lane(lanes, i):
                blocks.setdefault(a, []).append(
                    attend(queries[:, h:g, a - first:b - first], keys[:, h:g], values[:, h:g], bias_of(a, b)[:, h:g],
                           "ours", summing))
        out = mx.concatenate([mx.concatenate(heads, axis=1) for heads in blocks.values()], axis=2)
        return self.o(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gated = args.feed_forward_proj.startswith("gated-")
        # Hugging Face maps "gated-gelu" to the tanh approximation ("gelu_new").
        name = "gelu_new" if args.feed_forward_proj == "gated-gelu" else args.feed_forward_proj.split("-")[-1]
        self.act = _ACTIVATIONS[name]
        if self.gated:
            self.wi_0 = nn.Linear(args.d_model, args.d_ff, bias=False)
            self.wi_1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        else:
            self.wi = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        hidden = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(hidden)


def _clamp_float16(x: mx.array) -> mx.array:
    """Large v1.0 models overflow float16 in the residual stream; clamp as Hugging Face does."""
    if x.dtype != mx.float16:
        return x
    limit = float(mx.finfo(mx.float16).max) - 1000
    return mx.clip(x, -limit, limit)


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.ffn = FeedForward(args)

    def __call__(self, x: mx.array, bias_of, chunks: list[tuple[int, int]], lanes: tuple = ()) -> mx.array:
        """Keys and values for the whole input, then each chunk of rows on
        its own: attention over every key, the output projection and the FFN.
        bias_of(first, last): the attention bias of those rows."""
        h = self.attention_norm(x)
        keys_values = []
        for i, (first, last) in enumerate(chunks):
            with lane(lanes, i):
                keys_values.append(self.attention.project_keys_values(h[:, first:last]))
        keys = mx.concatenate([k for k, _ in keys_values], axis=2)
        values = mx.concatenate([v for _, v in keys_values], axis=2)
        if mx.default_device() == mx.cpu:  # our softmax (attend): its normaliser from the values' product
            values = with_summing_column(values)
        out = []
        for i, (first, last) in enumerate(chunks):
            with lane(lanes, i):
                y = x[:, first:last] + self.attention.attend_in_blocks(h[:, first:last], first, bias_of, (keys, values),
                                                                       from_lane(lanes, i))
                y = _clamp_float16(y)
                out.append(_clamp_float16(y + self.ffn(self.ffn_norm(y))))
        return mx.concatenate(out, axis=1)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attention_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.self_attention = Attention(args)
        self.cross_attention_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.cross_attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.ffn = FeedForward(args)

    def __call__(self, x, positions, self_bias, keys, values, cross_keys_values, cross_bias):
        """The new positions' states x (B * L, d_model), at `positions` (B, L):
        their keys and values are written into the self-attention storage
        (B, heads, capacity, d_kv), which the layer returns with its output."""
        h = self.self_attention_norm(x)
        new_keys_values = self.self_attention.project_keys_values(h, positions.shape[0])
        keys, values = (write(storage, positions, new) for storage, new in zip((keys, values), new_keys_values))
        x = _clamp_float16(x + self.self_attention(h, (keys, values), self_bias, softmax="mlx"))
        h = self.cross_attention(self.cross_attention_norm(x), cross_keys_values, cross_bias)
        x = _clamp_float16(x + h)
        return _clamp_float16(x + self.ffn(self.ffn_norm(x))), keys, values


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
        """Only these rows, in this order (finished rows leave a batch)."""
        if self.keys is not None:
            index = mx.array(rows)
            self.keys, self.values = self.keys[index], self.values[index]
        self.offsets = [self.offsets[row] for row in rows]

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
        self.offsets = self.offsets + other.offsets


class DecoderCache:
    """Everything the decoder keeps between steps for a batch of prompts:
    each layer's self-attention cache, and the cross-attention keys/values
    and encoder padding bias, computed once per prompt."""

    def __init__(self, cross_keys_values: list, cross_bias: mx.array | None):
        rows = cross_keys_values[0][0].shape[0]
        self.self_attention = [KVCache(rows) for _ in cross_keys_values]
        self.cross_keys_values = cross_keys_values
        self.cross_bias = cross_bias  # encoder padding mask (B, 1, 1, S); None: no padding

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
        """Only these rows, in this order; cross-attention cut to the first
        cross_length keys if given (the longest prompt left is shorter)."""
        index = mx.array(rows)
        for cache in self.self_attention:
            cache.keep(rows)
        cut = slice(None, cross_length)
        self.cross_keys_values = [(k[index, :, cut], v[index, :, cut]) for k, v in self.cross_keys_values]
        if self.cross_bias is not None:
            self.cross_bias = self.cross_bias[index, ..., cut]

    def extend(self, other: "DecoderCache") -> None:
        """Append other's rows (prompts encoded apart) after these. The
        shorter prompts' cross-attention keys are padded, and the padding masked."""
        length = max(cache.cross_keys_values[0][0].shape[2] for cache in (self, other))
        if self.cross_bias is not None or other.cross_bias is not None or \
                self.cross_keys_values[0][0].shape[2] != other.cross_keys_values[0][0].shape[2]:
            self.cross_bias = mx.concatenate([self.cross_bias_over(length), other.cross_bias_over(length)])
        self.cross_keys_values = [tuple(mx.concatenate([pad_length(a, length), pad_length(b, length)]) for a, b in zip(mine, theirs))
                                  for mine, theirs in zip(self.cross_keys_values, other.cross_keys_values)]
        for mine, theirs in zip(self.self_attention, other.self_attention):
            mine.extend(theirs)

    def cross_bias_over(self, length: int) -> mx.array:
        """The cross-attention bias (B, 1, 1, length): -inf at padding and past each prompt's end."""
        rows, _, own, _ = self.cross_keys_values[0][0].shape
        dtype = self.cross_keys_values[0][0].dtype
        bias = mx.zeros((rows, 1, 1, own), dtype) if self.cross_bias is None else self.cross_bias
        return mx.concatenate([bias, mx.full((rows, 1, 1, length - own), -mx.inf, dtype)], axis=-1)


def pad_length(x: mx.array, length: int) -> mx.array:
    """(B, H, S, D) keys or values with zeros after position S up to length."""
    missing = length - x.shape[2]
    return x if missing == 0 else mx.pad(x, [(0, 0), (0, 0), (0, missing), (0, 0)])


def padding_bias(mask: mx.array | None, dtype) -> mx.array | None:
    """(B, S) mask of 1 for tokens, 0 for padding -> additive (B, 1, 1, S) bias."""
    if mask is None:
        return None
    return mx.where(mask.astype(mx.bool_), 0.0, -mx.inf)[:, None, None, :].astype(dtype)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.relative_attention_bias = RelativePositionBias(args, bidirectional=True)
        self.layers = [EncoderLayer(args) for _ in range(args.num_layers)]
        self.final_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)

    def __call__(self, x: mx.array, mask: mx.array | None = None, lanes: tuple = ()) -> mx.array:
        """Rows go through in chunks and attention in blocks of queries
        (row_chunks, attention_blocks), so that memory grows with the input's
        length, not with its square."""
        L = x.shape[1]
        by_distance = self.relative_attention_bias.by_distance(L)
        padding = padding_bias(mask, x.dtype)

        def bias_of(first: int, last: int) -> mx.array:
            bias = bias_rows(by_distance, first, last, L)
            return bias if padding is None else bias + padding

        chunks = row_chunks(L, len(lanes))
        for layer in self.layers:
            x = layer(x, bias_of, chunks, lanes)
        return self.final_norm(x)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.relative_attention_bias = RelativePositionBias(args, bidirectional=False)
        self.layers = [DecoderLayer(args) for _ in range(args.num_decoder_layers)]
        self.final_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)

    def __call__(self, x, positions, keys, values, cross_keys_values, cross_bias):
        """The new tokens' embeddings x (B * L, d_model) at positions (B, L),
        each row at its own; keys and values: each layer's storage. Every
        query attends to the whole storage: the bias masks the future, and a
        row's stale or empty positions, so the shapes (and the compiled graph)
        change only when the storage grows by a block."""
        capacity = keys[0].shape[2]
        bias = self.relative_attention_bias(positions, capacity)
        unseen = mx.arange(capacity) > positions[..., None]
        bias = mx.where(unseen[:, None], mx.array(-mx.inf, bias.dtype), bias)
        new_keys, new_values = [], []
        for layer, k, v, cross_kv in zip(self.layers, keys, values, cross_keys_values):
            x, k, v = layer(x, positions, bias, k, v, cross_kv, cross_bias)
            new_keys.append(k)
            new_values.append(v)
        return self.final_norm(x), new_keys, new_values


class T5(nn.Module):
    most_traces = 64  # compiled decode-step shapes kept (compile_decoding)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = Encoder(args)
        self.decoder = Decoder(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.lanes = ()  # streams that independent blocks of a prompt's work spread over (cpu.py sets them)
        self._compiled_step = None  # compile_decoding sets it

    def encode(self, tokens: mx.array, mask: mx.array | None = None) -> mx.array:
        """(B, S) prompt ids (and optional padding mask) -> (B, S, d_model)."""
        return self.encoder(self.shared(tokens), mask, self.lanes)

    def make_cache(self, encoder_output: mx.array, mask: mx.array | None = None) -> DecoderCache:
        """Cross-attention keys/values are computed here, once per prompt."""
        cross = []
        for i, layer in enumerate(self.decoder.layers):
            with lane(self.lanes, i):
                cross.append(layer.cross_attention.project_keys_values(encoder_output))
        return DecoderCache(cross, padding_bias(mask, encoder_output.dtype))

    def decode(self, tokens: mx.array, cache: DecoderCache) -> mx.array:
        """(B, L) new decoder ids -> (B, L, vocab) logits; appends L positions to the cache."""
        length = tokens.shape[1]
        keys, values = cache.reserve(length)
        step = self._compiled_step or self.decode_step
        if self._compiled_step is not None:
            shapes = (tokens.shape, keys[0].shape, cache.cross_keys_values[0][0].shape, cache.cross_bias is None)
            if shapes not in self._traced:
                if len(self._traced) == self.most_traces:
                    step = self.compile_decoding()._compiled_step  # a fresh start: MLX frees the old traces
                self._traced.add(shapes)
        logits, keys, values = step(tokens, mx.array(cache.offsets), keys, values, cache.cross_keys_values, cache.cross_bias)
        cache.advance(length, keys, values)
        return logits

    def decode_step(self, tokens, offsets, keys, values, cross_keys_values, cross_bias):
        """decode as a function of arrays alone, whose shapes decide its graph:
        tokens (B, L) of rows whose caches hold offsets (B,) positions ->
        logits, and each layer's storage with the new positions written in."""
        B, L = tokens.shape
        positions = offsets[:, None] + mx.arange(L)
        x, keys, values = self.decoder(self.shared(tokens.reshape(-1)), positions, keys, values, cross_keys_values, cross_bias)
        if self.args.scale_decoder_outputs:
            x = x * self.args.d_model**-0.5
        logits = self.shared.as_linear(x) if self.args.tie_word_embeddings else self.lm_head(x)
        return logits.reshape(B, L, -1), keys, values

    def compile_decoding(self) -> "T5":
        """Run decode steps as compiled graphs, traced once per shape (rows,
        new tokens, prompt length, storage capacity; a trace costs about a
        step, and half a megabyte for the demo target: after `most_traces`
        shapes, a long session starts over with none): MLX then replays the traced graph instead of running the
        Python that builds it, and fuses its elementwise work, which is much
        of a narrow model's step (bench.py steps). The weights become
        constants of those graphs, so compile once they are final: changing
        them with update or update_modules turns compilation off again, and
        after any other change (assigning a weight or a layer, patching a
        function the step calls) call this again. Models built directly, as
        training builds them, are not compiled."""
        mx.eval(self.parameters())  # a lazy weight would be recomputed inside every step
        self._compiled_step = mx.compile(self.decode_step)
        self._traced = set()  # the shapes traced so far
        return self

    def update(self, parameters: dict, strict: bool = True) -> "T5":
        self._compiled_step = None
        return super().update(parameters, strict)

    def update_modules(self, modules: dict, strict: bool = True) -> "T5":
        self._compiled_step = None
        return super().update_modules(modules, strict)


# ---------------------------------------------------------------- loading


class T5Error(Exception):
    """A problem the caller can fix: a model that cannot be used, an option out of range."""


class LoadError(T5Error):
    """A model that cannot be loaded: not converted, damaged, or not a draft for its target."""


class ModelNotFound(LoadError):
    def __init__(self, message: str, role: str):
        super().__init__(message)
        self.role = role  # "target" or "draft"


MODELS_DIR = Path("mlx_models")  # where convert.py writes by default
REPOSITORY = Path(__file__).resolve().parent


def read_config(folder: str | Path) -> dict:
    """The config of a folder written by convert.py; LoadError otherwise."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise LoadError(f"{folder} is not a folder")
    if not config_file.is_file():
        raise LoadError(f"{folder} has no config.json: not a converted model")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{config_file} is damaged ({e}): convert the model again")
    if FORMAT_KEY not in config:
        raise LoadError(f"{folder} is not a converted MLX model (a Hugging Face checkpoint? run: python convert.py --model {folder})")
    return config


def resolve(name: str | Path, role: str = "model") -> Path:
    """The converted folder a name means: a path; else mlx_models/NAME; else,
    for a hub id ORG/REPO, the mlx_models/REPO that convert.py made from that
    very id. A relative name is looked up from the current folder, then from
    this repository's. `role` ("target", "draft") names the model in errors."""
    name = str(name)
    if not name.strip():
        raise ModelNotFound(f"no {role} named", role)
    path = Path(name).expanduser()
    bases = [Path()]
    if not path.is_absolute() and Path.cwd().resolve() != REPOSITORY:
        bases.append(REPOSITORY)
    candidates = list(dict.fromkeys(base / sub / path for base in bases for sub in (Path(), MODELS_DIR)))
    problem = None
    for folder in candidates:
        if folder.is_dir():
            try:
                read_config(folder)
                return folder
            except LoadError as e:
                problem = problem or e
    org, _, repo = name.partition("/")
    if org and repo and "/" not in repo:  # a hub id: convert.py wrote mlx_models/REPO and recorded the id
        for base in bases:
            folder = base / MODELS_DIR / repo
            try:
                if read_config(folder)[FORMAT_KEY].get("source") == name:
                    return folder
            except LoadError:
                pass
    if problem:
        raise problem
    if path.is_file():
        raise LoadError(f"{role} {name} is a file: give a folder written by convert.py")
    looked = " and ".join(str(folder) for folder in candidates)
    raise ModelNotFound(f"no converted {role} '{name}' (looked for {looked}): run `python convert.py --model {name}` first", role)


def weight_files(folder: Path, config: dict) -> list[Path]:
    return [folder / name for name in config[FORMAT_KEY]["weight_files"]]


def load_model(folder: str | Path) -> T5:
    """Load a converted folder, every weight read and decoding compiled."""
    return open_model(folder).compile_decoding()


def open_model(folder: str | Path) -> T5:
    """A converted folder's model, checked against its config, its weights
    not read yet: mx.load maps the safetensors lazily (never copying through
    numpy), so they are read on first use. In a quantized folder (its config
    says "quantization"), the layers with `.scales` are quantized ones."""
    folder = Path(folder)
    config = read_config(folder)
    model = T5(ModelArgs.from_dict(config))
    weights = {}
    for path in weight_files(folder, config):
        try:
            weights.update(mx.load(str(path)))
        except RuntimeError as e:  # missing, truncated or corrupt
            raise LoadError(f"{path} cannot be read ({e}): convert the model again")
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(model, q["group_size"], q["bits"], mode=q.get("mode", "affine"),
                    class_predicate=lambda path, module: f"{path}.scales" in weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # a weight missing, extra or of the wrong shape
        detail = " ".join(str(e).split())  # one line: MLX lists the names on lines of their own
        raise LoadError(f"{folder}'s weights do not match its config ({detail[:200]}): convert the model again")
    model.eval()
    return cpu.use_cores(model)


class Tokenizer:
    """A converted model's tokenizer, read from its tokenizer.json with the
    `tokenizers` library: starting up imports neither transformers nor PyTorch.
    It encodes as transformers' T5 tokenizer does (EOS appended) and decodes
    special tokens as text, without "cleaning up" spaces."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Rust

        self.backend = Rust.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids: list[int], **_) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer: from tokenizer.json (convert.py writes one);
    for a folder with only spiece.model, transformers' (a slower start)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        try:
            return Tokenizer(folder / "tokenizer.json")
        except Exception as e:  # the Rust library's errors have no common type
            raise LoadError(f"{folder} has a damaged tokenizer.json ({str(e).splitlines()[0]}): convert the model again")
    # Without these files transformers quietly builds a tokenizer of special tokens only.
    if not (folder / "spiece.model").is_file():
        raise LoadError(f"{folder} has no tokenizer (tokenizer.json or spiece.model): convert the model again")
    from transformers import AutoTokenizer  # slow import: only when needed

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise LoadError(f"{folder} has a damaged tokenizer ({str(e).splitlines()[0]}): convert the model again")


@dataclass
class Models:
    """A target, its draft (None: regular decoding only) and their shared
    tokenizer; `drafting` keeps what num_draft "auto" learnt about the pair
    (decoder.AutoDraft) for each delta, sampling setting and batch size, from
    one generation to the next."""

    target: T5
    draft: T5 | None
    tokenizer: object
    target_path: Path
    draft_path: Path | None = None
    drafting: dict = field(default_factory=dict, repr=False)


_warned_slow_blas = False


def check_fit(path: Path, model: T5, tokenizer) -> None:
    """Warn, once per model, of what would make its output empty or slow."""
    # T5 pads its vocabulary to a multiple of 128 (32128 rows for 32100 pieces);
    # beyond that, the model can choose tokens the tokenizer prints as nothing.
    known = -(-len(tokenizer) // 128) * 128
    if model.args.vocab_size > known:
        warnings.warn(f"{path} has {model.args.vocab_size:,} output tokens but its tokenizer only {len(tokenizer):,}: "
                      "tokens past those print as nothing (a tokenizer from another model?)", RuntimeWarning, stacklevel=3)
    dtype = model.shared.weight.dtype if not hasattr(model.shared, "scales") else model.shared.scales.dtype
    if mx.default_device() == mx.cpu and dtype in (mx.bfloat16, mx.float16):
        warnings.warn(f"{path} is {str(dtype).split('.')[-1]}: MLX's CPU backend has no fast half-precision products, "
                      "it decodes several times slower than float32 (convert with --dtype float32)", RuntimeWarning, stacklevel=3)


def load(target: str | Path, *, draft: str | Path | None = None, verbose: bool = False) -> Models:
    """Load a converted target (and draft) by folder, name under mlx_models/,
    or the hub id it was converted from. Every weight is read now (verbose:
    saying so on stderr), so the first generation's time is decoding, not
    disk reads. A draft must share the target's tokenizer; that is checked
    before any weights load."""
    global _warned_slow_blas
    target_path = resolve(target, "target")
    draft_path = resolve(draft, "draft") if draft is not None else None
    tokenizer = load_tokenizer(target_path)
    if draft_path is not None:
        target_vocab, draft_vocab = read_config(target_path)["vocab_size"], read_config(draft_path)["vocab_size"]
        if draft_vocab != target_vocab:
            raise LoadError(f"{draft} has {draft_vocab} output tokens, {target} {target_vocab}: not a draft for it")
        if load_tokenizer(draft_path).get_vocab() != tokenizer.get_vocab():
            raise LoadError(f"{draft} and {target} have different tokenizers: the draft must share the target's")
    if cpu.SLOW and not _warned_slow_blas:  # once per process, whatever the warning filters say
        _warned_slow_blas = True
        advice = ": several times slower; import model, decoder or cpu before mlx.core" if cpu.ACTIVE == cpu.MLX_FIRST else ""
        warnings.warn(f"MLX's CPU backend runs on its {cpu.ACTIVE}{advice}", RuntimeWarning, stacklevel=2)
    target_model = open_model(target_path)
    draft_model = open_model(draft_path) if draft_path is not None else None
    if verbose:  # on stderr: stdout may carry a program's output (main.py --json)
        names = [os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
                 for path in (target_path, draft_path) if path is not None]
        print(f"Loading {' and '.join(names)} ...", file=sys.stderr, flush=True)
        if (kernels := cpu.uncompiled_kernels()) is not None:
            print(f"First run of MLX {mx.__version__} here: its CPU kernels are compiled as they are first needed "
                  f"(once, kept in {kernels}), which slows the first generation by up to half a minute.",
                  file=sys.stderr, flush=True)
    for path, model in ((target_path, target_model), (draft_path, draft_model)):
        if model is not None:
            model.compile_decoding()  # reads every weight
            check_fit(path, model, tokenizer)
    return Models(target_model, draft_model, tokenizer, target_path.resolve(), draft_path and draft_path.resolve())
