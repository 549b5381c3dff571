"""The encoder-decoder in MLX, with the caches incremental decoding needs.

One module per piece of the paper: relative position bias, attention, the
feed-forward block, encoder and decoder layers. T5 is the default: v1.0
(ReLU, head tied to the embedding and scaled by d_model**-0.5) and v1.1 /
FLAN-T5 / mT5 (gated GELU, separate head, no scaling). The other families
are configurations of the same modules, ModelArgs' switches (families.py
reads them off a checkpoint's config): umT5's relative bias in every layer;
the BART family's position tables, LayerNorms before or after each block,
biases in every projection and on the logits.

Decoding state is explicit: a `DecoderCache` (cache.py) holds, per decoder
layer, a growing self-attention `KVCache` (trimmable, for speculative
rollback) and the cross-attention keys/values computed once from the encoder
output.

How attention is computed on each path is attention.py's; reading converted
folders is loading.py's.
"""

import math
from dataclasses import dataclass, fields
from typing import Generator

import cpu  # must precede mlx.core: picks a fast BLAS on Linux
import mlx.core as mx
import mlx.nn as nn

from attention import attend, block_rows, cross_weights, exp_below_zero, prompt_values
from cache import DecoderCache, write


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
    # What sets a family apart (families.py reads them off a checkpoint's config); these defaults are T5's.
    positions: str = "relative"  # T5's bucketed bias; "relative per layer" (umT5); "absolute": a table added to the embeddings
    position_offset: int = 0  # absolute: the table's row for position 0 (BART's and mBART's tables start at 2)
    max_positions: int = 0  # absolute: the table's rows
    norm: str = "rms"  # "rms" (T5's, no bias) or "layer" (LayerNorm)
    pre_norm: bool = True  # each block normalises its input (T5, mBART, Pegasus, NLLB), or its sum with it (BART, Marian)
    final_norm: bool = True  # a norm after each stack's last layer
    embedding_norm: bool = False  # a norm after the embeddings (BART's and mBART's layernorm_embedding)
    embedding_scale: float = 1.0  # the embeddings times this (sqrt(d_model) where a config says scale_embedding)
    linear_bias: bool = False  # every projection has a bias (the BART family)
    logits_bias: bool = False  # a bias added to the logits (final_logits_bias)
    num_mel_bins: int = 0  # speech (Whisper): the log-mel bins its input layer (AudioStem) takes; 0: token ids
    encoder_positions: int = 0  # absolute: the encoder's table's rows, where they differ from the decoder's (Whisper)
    forced_bos_token_id: int | None = None  # the first output token, whatever the logits (rows.forced)
    forced_eos_token_id: int | None = None  # the end of text forced at max_tokens
    head_tokens: int = 0  # a draft's head scores these tokens alone (head_ids; FR-Spec), every other one at -inf

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        names = {f.name for f in fields(cls)}
        args = {k: v for k, v in config.items() if k in names and v is not None}
        if isinstance(args.get("forced_eos_token_id"), list):  # a config may name several: the first is forced
            args["forced_eos_token_id"] = args["forced_eos_token_id"][0]
        args.setdefault("num_decoder_layers", config["num_layers"])
        return cls(**args)


# The CPU path's activations. There MLX's erf, tanh and sigmoid are a library call per element: a GELU over an encoder
# layer's FFN cost as much as its products (Whisper small's shapes). Built of multiplies and adds, which MLX's CPU
# compile fuses into one loop, they cost a fraction of that, equal to float32 precision (tests/test_model.py): erf
# as a rational function of x² (Eigen's, odd numerator over even denominator, on [-4, 4], where erf reaches 1 in
# float32), the sigmoid from attention.py's exponential of -|x|. In float32 whatever the input's type: the
# coefficients' span would be lost in half precision.
_ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                  -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)  # of x**13 down to x**1
_ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                    -1.42647390514189e-02)  # of x**8 down to x**0


@mx.compile
def _gelu_by_rational_erf(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    z = mx.clip(x32 * (1 / math.sqrt(2)), -4.0, 4.0)
    y = z * z
    y2 = y * y
    a, b = _ERF_NUMERATOR, _ERF_DENOMINATOR
    # both polynomials in y, evaluated in pairs (Estrin's order): a shallow graph fuses whole
    numerator = ((a[0] * y + a[1]) * y2 + (a[2] * y + a[3])) * (y2 * y) + ((a[4] * y + a[5]) * y + a[6])
    denominator = (b[0] * y + b[1]) * (y2 * y) + (b[2] * y + b[3]) * y + b[4]
    return (0.5 * x32 * (1 + z * numerator / denominator)).astype(x.dtype)


@mx.compile
def _tanh_gelu_argument(x: mx.array) -> mx.array:
    """2 sqrt(2 / pi) (x + 0.044715 x**3): the tanh approximation's 0.5 (1 + tanh(u)) is sigmoid(2u)."""
    x = x.astype(mx.float32)
    return (2 * math.sqrt(2 / math.pi)) * (x + 0.044715 * x * x * x)


def _sigmoid_on_cpu(x: mx.array) -> mx.array:
    """(Its gradient at exactly 0 is 0, abs's there, not 1/4: SiLU and the tanh GELU multiply it by x, which is 0.)"""
    small = exp_below_zero(-mx.abs(x))  # e**-|x|, never overflows
    return mx.where(x >= 0, 1.0, small) / (1 + small)


def gelu(x: mx.array) -> mx.array:
    """The exact (erf) GELU, as Hugging Face's "gelu"."""
    return _gelu_by_rational_erf(x) if cpu.in_use() else nn.gelu(x)


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU's tanh approximation, as Hugging Face's "gelu_new"."""
    if not cpu.in_use():
        return nn.gelu_approx(x)
    return (x.astype(mx.float32) * _sigmoid_on_cpu(_tanh_gelu_argument(x))).astype(x.dtype)


def silu(x: mx.array) -> mx.array:
    if not cpu.in_use():
        return nn.silu(x)
    return (x.astype(mx.float32) * _sigmoid_on_cpu(x.astype(mx.float32))).astype(x.dtype)


_ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "silu": silu,
    "swish": silu,  # Marian's name for it
}


def mean_by_columns(x: mx.array, columns: int = 16) -> mx.array:
    """The mean of x's last axis, kept, summed as `columns` interleaved partial sums first. MLX's CPU backend sums
    an axis in one running float32 sum, whose error grows with its length: a mean over 4,096 values was 20 times
    as far from float64 as numpy's or PyTorch's (docs/DECISIONS.md); 16 partial sums bring it back to theirs."""
    width = x.shape[-1]
    while width % columns:
        columns //= 2
    return x.reshape(*x.shape[:-1], width // columns, columns).sum(-2).sum(-1, keepdims=True) * (1 / width)


class LayerNorm(nn.LayerNorm):
    """MLX's LayerNorm (its fused kernel on an accelerator); on the CPU path, its mean and variance summed in
    columns (mean_by_columns), as near float64 as PyTorch's."""

    def __call__(self, x: mx.array) -> mx.array:
        if not cpu.in_use():
            return super().__call__(x)
        x32 = x.astype(mx.float32)
        centred = x32 - mean_by_columns(x32)
        normalised = centred * mx.rsqrt(mean_by_columns(centred * centred) + self.eps)
        return (normalised * self.weight + self.bias).astype(x.dtype)


class RMSNorm(nn.RMSNorm):
    """MLX's RMSNorm (T5's); on the CPU path, its mean square summed in columns, as LayerNorm's."""

    def __call__(self, x: mx.array) -> mx.array:
        if not cpu.in_use():
            return super().__call__(x)
        x32 = x.astype(mx.float32)
        return (x32 * mx.rsqrt(mean_by_columns(x32 * x32) + self.eps)).astype(x.dtype) * self.weight


def make_norm(args: "ModelArgs") -> nn.Module:
    if args.norm == "layer":
        return LayerNorm(args.d_model, eps=args.layer_norm_epsilon)
    return RMSNorm(args.d_model, eps=args.layer_norm_epsilon)


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


# Long inputs are encoded in chunks of rows (projections, attention's queries
# and the FFN): big enough for the BLAS to run near its peak, and at least
# one per lane (core) on the CPU path. A chunk's attention goes in spans of
# rows, each as many as one of attention.py's blocks of every head takes, so
# that its scores are bounded: each span a piece of the work the server can
# evaluate between decoding rounds (EncoderLayer.pieces). Chunks bounded by
# the scores themselves made a long prompt's products small (64 rows at 8,193
# tokens), which took the demo target 1.2 times as long.
ROWS_PER_CHUNK = 512


def row_chunks(length: int, lanes: int) -> list[tuple[int, int]]:
    """Chunks of at most ROWS_PER_CHUNK rows, one per lane at least."""
    size = min(ROWS_PER_CHUNK, -(-length // max(1, lanes)))
    return [(first, min(first + size, length)) for first in range(0, length, size)]


def attention_spans(first: int, last: int, length: int, heads: int) -> list[tuple[int, int]]:
    """Rows first..last-1 of a length-long input in spans of about one size, each at most the rows of one block of
    attention over every head (attention.block_rows)."""
    count = -(-(last - first) // block_rows(heads, length))
    size = -(-(last - first) // count)
    return [(a, min(a + size, last)) for a in range(first, last, size)]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_heads
        inner = args.num_heads * args.d_kv
        # Scale 1 (attention.py): T5 folds 1/sqrt(d_kv) into its initialisation, and convert.py into the
        # queries' projection for the families that scale (families.py).
        self.q = nn.Linear(args.d_model, inner, bias=args.linear_bias)
        self.k = nn.Linear(args.d_model, inner, bias=args.linear_bias)
        self.v = nn.Linear(args.d_model, inner, bias=args.linear_bias)
        self.o = nn.Linear(inner, args.d_model, bias=args.linear_bias)

    def split_heads(self, x: mx.array, rows: int | None = None) -> mx.array:
        """(B, L, inner), or (B * L, inner) given rows=B -> (B, heads, L, d_kv)."""
        d_kv = x.shape[-1] // self.num_heads
        if x.ndim == 2 and x.shape[0] == rows:  # one position a row: no transpose (one operation fewer a step)
            return x.reshape(rows, self.num_heads, 1, d_kv)
        return x.reshape(rows or x.shape[0], -1, self.num_heads, d_kv).transpose(0, 2, 1, 3)

    @staticmethod
    def merge_heads(out: mx.array) -> mx.array:
        """(B, heads, L, d_kv) -> (B * L, inner)."""
        B, H, L, D = out.shape
        return (out if L == 1 else out.transpose(0, 2, 1, 3)).reshape(B * L, H * D)

    def project_keys_values(self, x: mx.array, rows: int | None = None) -> tuple[mx.array, mx.array]:
        return self.split_heads(self.k(x), rows), self.split_heads(self.v(x), rows)

    def __call__(self, x: mx.array, keys_values: tuple[mx.array, mx.array], bias: mx.array | None, kind: str) -> mx.array:
        """x's queries over keys_values: the decoder's cached self-attention
        (kind "self") or the prompt's cross-attention ("cross"). x is (B * L,
        d_model): the decoder keeps its states as a matrix, whose products
        need no reshaping around them."""
        out = attend(self.split_heads(self.q(x), keys_values[0].shape[0]), *keys_values, bias, kind)
        return self.o(self.merge_heads(out))

    def merged_output(self, out: mx.array) -> mx.array:
        """The output projection of a long input's attention, (B, heads, L, d_kv) -> (B, L, d_model)."""
        B, _, L, _ = out.shape
        return self.o(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gated = args.feed_forward_proj.startswith("gated-")
        # Hugging Face maps "gated-gelu" to the tanh approximation ("gelu_new").
        name = "gelu_new" if args.feed_forward_proj == "gated-gelu" else args.feed_forward_proj.split("-")[-1]
        self.act = _ACTIVATIONS[name]
        bias = args.linear_bias
        if self.gated:
            self.wi_0 = nn.Linear(args.d_model, args.d_ff, bias=bias)
            self.wi_1 = nn.Linear(args.d_model, args.d_ff, bias=bias)
        else:
            self.wi = nn.Linear(args.d_model, args.d_ff, bias=bias)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        hidden = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(hidden)


def clamp_float16(x: mx.array) -> mx.array:
    """Large v1.0 models overflow float16 in the residual stream; clamp as Hugging Face does."""
    if x.dtype != mx.float16:
        return x
    limit = float(mx.finfo(mx.float16).max) - 1000
    return mx.clip(x, -limit, limit)


# Work in pieces: a generator yields lists of (lazy) arrays, each a piece whose evaluation is part of the work, and
# returns the result, which the pieces' evaluation has computed (or, evaluated at once, computes).
Pieces = Generator[list[mx.array], None, mx.array]


def drained(pieces: Pieces) -> mx.array:
    """What pieces return, none evaluated: the whole work as one graph."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.pre_norm = args.pre_norm
        self.attention_norm = make_norm(args)
        self.attention = Attention(args)
        self.ffn_norm = make_norm(args)
        self.ffn = FeedForward(args)
        if args.positions == "relative per layer":
            self.relative_attention_bias = RelativePositionBias(args, bidirectional=True)

    def pieces(self, x: mx.array, bias_of, chunks: list[tuple[int, int]], lanes: tuple = ()) -> Pieces:
        """Keys and values for the whole input, then each chunk of rows on
        its own lane: attention over every key, the output projection and the
        FFN. bias_of(first, last): the attention bias of those rows. Yields
        the work in pieces (the keys and values; then, a chunk per lane at a
        time, its attention a span at a time where it has several, and the
        rest) and returns the layer's output."""
        h = self.attention_norm(x) if self.pre_norm else x
        keys_values = []
        for i, (first, last) in enumerate(chunks):
            with cpu.lane(lanes, i):
                keys_values.append(self.attention.project_keys_values(h[:, first:last]))
        keys = mx.concatenate([k for k, _ in keys_values], axis=2)
        values = prompt_values(mx.concatenate([v for _, v in keys_values], axis=2))
        yield [keys, values]
        out, side_by_side = [], max(1, len(lanes))  # a chunk per lane: they run side by side
        for start in range(0, len(chunks), side_by_side):
            group = list(enumerate(chunks))[start : start + side_by_side]
            attended = yield from self.attention_in_spans(h, (keys, values), bias_of, group, lanes)
            for i, (first, last) in group:
                with cpu.lane(lanes, i):
                    y = x[:, first:last] + self.attention.merged_output(attended[i])
                    if self.pre_norm:
                        y = clamp_float16(y)
                        out.append(clamp_float16(y + self.ffn(self.ffn_norm(y))))
                    else:  # the sums normalised
                        y = self.attention_norm(y)
                        out.append(self.ffn_norm(y + self.ffn(y)))
            yield out[-len(group):]
        return mx.concatenate(out, axis=1)

    def attention_in_spans(self, h: mx.array, keys_values: tuple, bias_of, group: list, lanes: tuple) -> Pieces:
        """The attention of a group of chunks (i, (first, last)), a chunk per lane, over every key: each chunk's
        queries in spans (attention_spans), which take the lanes in turn. Yields a span of each chunk at a time
        where the chunks have several (a chunk of one span: its attention goes in the piece with the rest of the
        chunk) and returns each chunk's output (B, heads, rows, d_kv), by i."""
        length, attended, queries = h.shape[1], {i: [] for i, _ in group}, {}
        spans = {i: attention_spans(first, last, length, self.attention.num_heads) for i, (first, last) in group}
        for i, (first, last) in group:
            with cpu.lane(lanes, i):
                queries[i] = self.attention.split_heads(self.attention.q(h[:, first:last]))
        for k in range(max(len(rows) for rows in spans.values())):
            for i, (first, _) in group:
                if k < len(spans[i]):
                    a, b = spans[i][k]
                    with cpu.lane(lanes, i + k):  # (as a span's blocks take them)
                        span_bias = lambda c, d, a=a: bias_of(a + c, a + d)  # noqa: E731
                        attended[i].append(attend(queries[i][:, :, a - first : b - first], *keys_values, span_bias,
                                                  "prompt", cpu.from_lane(lanes, i + k)))
            if len(spans[group[0][0]]) > 1:
                yield [spans_out[k] for spans_out in attended.values() if k < len(spans_out)]
        return {i: mx.concatenate(spans_out, axis=2) for i, spans_out in attended.items()}


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.pre_norm = args.pre_norm
        self.self_attention_norm = make_norm(args)
        self.self_attention = Attention(args)
        self.cross_attention_norm = make_norm(args)
        self.cross_attention = Attention(args)
        self.ffn_norm = make_norm(args)
        self.ffn = FeedForward(args)
        if args.positions == "relative per layer":
            self.relative_attention_bias = RelativePositionBias(args, bidirectional=False)

    def __call__(self, x, positions, self_bias, keys, values, cross_keys_values, cross_bias):
        """The new positions' states x (B * L, d_model), at `positions` (B, L):
        their keys and values are written into the self-attention storage
        (B, heads, capacity, d_kv), which the layer returns with its output."""
        if not self.pre_norm:
            return self.post_norm(x, positions, self_bias, keys, values, cross_keys_values, cross_bias)
        h = self.self_attention_norm(x)
        new_keys_values = self.self_attention.project_keys_values(h, positions.shape[0])
        keys, values = (write(storage, positions, new) for storage, new in zip((keys, values), new_keys_values))
        x = clamp_float16(x + self.self_attention(h, (keys, values), self_bias, "self"))
        h = self.cross_attention(self.cross_attention_norm(x), cross_keys_values, cross_bias, "cross")
        x = clamp_float16(x + h)
        return clamp_float16(x + self.ffn(self.ffn_norm(x))), keys, values

    def post_norm(self, x, positions, self_bias, keys, values, cross_keys_values, cross_bias):
        """The layer as BART and Marian have it: each sum with the block's input normalised."""
        new_keys_values = self.self_attention.project_keys_values(x, positions.shape[0])
        keys, values = (write(storage, positions, new) for storage, new in zip((keys, values), new_keys_values))
        x = self.self_attention_norm(x + self.self_attention(x, (keys, values), self_bias, "self"))
        x = self.cross_attention_norm(x + self.cross_attention(x, cross_keys_values, cross_bias, "cross"))
        return self.ffn_norm(x + self.ffn(x)), keys, values


def padding_bias(mask: mx.array | None, dtype) -> mx.array | None:
    """(B, S) mask of 1 for tokens, 0 for padding -> additive (B, 1, 1, S) bias."""
    if mask is None:
        return None
    return mx.where(mask.astype(mx.bool_), 0.0, -mx.inf)[:, None, None, :].astype(dtype)


def embedded(stack: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """A stack's token embeddings x (..., d_model) at `positions` (...) as its
    first layer takes them: scaled, the positions' table added, normalised,
    as the family has it (none of it for T5)."""
    args = stack.args
    if args.embedding_scale != 1.0:
        x = x * args.embedding_scale
    if args.positions == "absolute":
        # A drafted round may run a row's padding drafts past the table's end (outputs thrown away): MLX's gather
        # would read past it unchecked.
        last = stack.positions.weight.shape[0] - 1  # (position tables are never quantized)
        x = x + stack.positions(mx.minimum(positions + args.position_offset, last))
    if args.embedding_norm:
        x = stack.embedding_norm(x)
    return x


class Stack(nn.Module):
    """What the encoder and the decoder share: the positions (T5's relative
    bias, here or in each layer, or a table), the embeddings' norm, the layers
    and the final norm.
    Split into pipeline stages (pipeline.py), a stack holds some of its layers:
    the stage that `starts` it embeds its input, the one that `ends` it
    normalises its output; the others take and give hidden states."""

    starts = ends = True

    def __init__(self, args: ModelArgs, layer, count: int, bidirectional: bool, positions: int = 0):
        super().__init__()
        self.args = args
        if args.positions == "relative":
            self.relative_attention_bias = RelativePositionBias(args, bidirectional=bidirectional)
        elif args.positions == "absolute":
            self.positions = nn.Embedding(positions or args.max_positions, args.d_model)
        if args.embedding_norm:
            self.embedding_norm = make_norm(args)
        self.layers = [layer(args) for _ in range(count)]
        if args.final_norm:
            self.final_norm = make_norm(args)

    def finish(self, x: mx.array) -> mx.array:
        return self.final_norm(x) if self.args.final_norm and self.ends else x


class Encoder(Stack):
    def __init__(self, args: ModelArgs):
        super().__init__(args, EncoderLayer, args.num_layers, bidirectional=True, positions=args.encoder_positions)

    def pieces(self, x: mx.array, mask: mx.array | None = None, lanes: tuple = ()) -> Pieces:
        """Rows go through in chunks and attention in spans and blocks of
        queries (row_chunks, attention_spans, attention_blocks), so that memory grows with the input's
        length, not with its square. Yields the work in pieces (each layer's)
        and returns the output."""
        B, L = x.shape[:2]
        x = embedded(self, x, mx.arange(L)) if self.starts else x
        padding = padding_bias(mask, x.dtype)
        heads = self.args.num_heads

        def biases(relative: RelativePositionBias | None):
            """bias_of(first, last), the bias of rows first..last-1 of every head (B or 1, heads, rows, L), or None."""
            if relative is None:  # absolute positions: the padding alone, or no bias (the scores' product adds none)
                return lambda a, b: None if padding is None else mx.broadcast_to(padding, (B, heads, b - a, L))
            by_distance = relative.by_distance(L)

            def bias_of(first: int, last: int) -> mx.array:
                bias = bias_rows(by_distance, first, last, L)
                return bias if padding is None else bias + padding
            return bias_of

        chunks = row_chunks(L, len(lanes))
        shared = biases(getattr(self, "relative_attention_bias", None)) if self.args.positions != "relative per layer" else None
        for layer in self.layers:
            x = yield from layer.pieces(x, shared or biases(layer.relative_attention_bias), chunks, lanes)
        return self.finish(x)


class Decoder(Stack):
    def __init__(self, args: ModelArgs):
        super().__init__(args, DecoderLayer, args.num_decoder_layers, bidirectional=False)

    def __call__(self, x, positions, keys, values, cross_keys_values, cross_bias):
        """The new tokens' embeddings x (B * L, d_model) at positions (B, L),
        each row at its own; keys and values: each layer's storage. Every
        query attends to the whole storage: the bias masks the future, and a
        row's stale or empty positions, so the shapes (and the compiled graph)
        change only when the storage grows by a block."""
        capacity = keys[0].shape[2]
        x = embedded(self, x, positions.reshape(-1)) if self.starts else x
        unseen = mx.arange(capacity) > positions[..., None]

        def masked(relative: RelativePositionBias | None) -> mx.array:
            if relative is None:  # absolute positions: the mask alone
                return mx.where(unseen[:, None], mx.array(-mx.inf, x.dtype), mx.array(0, x.dtype))
            bias = relative(positions, capacity)
            return mx.where(unseen[:, None], mx.array(-mx.inf, bias.dtype), bias)

        per_layer = self.args.positions == "relative per layer"
        bias = None if per_layer else masked(getattr(self, "relative_attention_bias", None))
        new_keys, new_values = [], []
        for layer, k, v, cross_kv in zip(self.layers, keys, values, cross_keys_values):
            layer_bias = masked(layer.relative_attention_bias) if per_layer else bias
            x, k, v = layer(x, positions, layer_bias, k, v, cross_kv, cross_bias)
            new_keys.append(k)
            new_values.append(v)
        return self.finish(x), new_keys, new_values


class AudioStem(nn.Module):
    """Whisper's input layer: log-mel frames (B, frames, bins) through two
    convolutions of width 3, each followed by GELU, the second of stride 2:
    (B, frames / 2, d_model)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.conv1 = nn.Conv1d(args.num_mel_bins, args.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(args.d_model, args.d_model, kernel_size=3, stride=2, padding=1)

    def __call__(self, frames: mx.array) -> mx.array:
        return gelu(self.conv2(gelu(self.conv1(frames))))


class EncoderDecoder(nn.Module):
    """The one encoder-decoder: T5's by default, every other family a
    configuration of it (ModelArgs). Prompts encode once (encode,
    make_cache); the decoder then steps through its cache (decode), each
    step compiled for its shapes (compile_decoding)."""

    most_traces = 64  # compiled decode-step shapes kept (compile_decoding)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        if args.num_mel_bins:
            self.stem = AudioStem(args)
        self.encoder = Encoder(args)
        self.decoder = Decoder(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        if args.logits_bias:
            self.final_logits_bias = mx.zeros((args.vocab_size,))
        if args.head_tokens:
            self.head_ids = mx.zeros((args.head_tokens,), mx.int32)
        self._head_columns = None  # the output layer's rows of head_ids, once taken (head_tokens, head_columns)
        self.steps = Plain()  # how decode steps run: op by op, until compile_decoding
        self._paused = None  # the compiled steps while `compiled` is switched off
        self.cold_steps = 0  # decode steps that ran a shape for the first time, or traced it (compile_decoding)

    @property
    def longest_input(self) -> int | None:
        """The most positions a prompt, or an output, may take: an absolute
        positions table's rows past its offset; None for relative positions."""
        return self.args.max_positions - self.args.position_offset if self.args.positions == "absolute" else None

    @property
    def cache_bytes_per_token(self) -> int:
        """What a row's cache holds for each of its tokens in every decoder
        layer: a prompt token's cross-attention keys and values, or an output
        token's own (the same size)."""
        return self.args.num_decoder_layers * self.cache_bytes_per_layer

    @property
    def cache_bytes_per_layer(self) -> int:
        """cache_bytes_per_token's share of one decoder layer."""
        activations = getattr(self.shared, "scales", self.shared.weight).dtype  # a quantized embedding's: its scales'
        return 2 * self.args.num_heads * self.args.d_kv * activations.size

    def encode(self, source: mx.array, mask: mx.array | None = None, lanes: tuple | None = None) -> mx.array:
        """(B, S) prompt ids, or (B, S, F) features (rows.Request.source), and an
        optional padding mask -> (B, S, d_model). Independent blocks of the work
        take the lanes (streams) in turn: by default cpu.lanes(), one per core
        on the CPU path, none elsewhere."""
        return drained(self.encoding(source, mask, lanes))

    def encoding(self, source: mx.array, mask: mx.array | None = None, lanes: tuple | None = None) -> Pieces:
        """encode's work, yielded in pieces (lists of arrays) that can be
        evaluated one at a time, between other work (rows.Encoding); returns
        the output."""
        lanes = cpu.lanes() if lanes is None else lanes
        return (yield from self.encoder.pieces(self.source_input(source), mask, lanes))

    def source_input(self, source: mx.array) -> mx.array:
        """The encoder's input layer, as the family has it: token ids through
        the shared embedding (every text family), or speech's log-mel frames
        (B, frames, bins) through its stem."""
        if self.args.num_mel_bins:
            return self.stem(source.astype(self.stem.conv1.weight.dtype))
        return self.shared(source)

    def make_cache(self, encoder_output: mx.array, mask: mx.array | None = None,
                   lanes: tuple | None = None) -> DecoderCache:
        """Cross-attention keys/values are computed here, once per prompt, the
        layers taking the lanes in turn (as encode). The prompt's positions
        are padded to a multiple of DecoderCache.prompt_block, the padding
        masked, so that prompts of about one length share compiled steps."""
        rows, length, _ = encoder_output.shape
        missing = DecoderCache.room(length) - length
        mask = mx.ones((rows, length), mx.int32) if mask is None else mask
        if missing:
            encoder_output = mx.pad(encoder_output, [(0, 0), (0, missing), (0, 0)])  # zeros: keys and values of 0
            mask = mx.pad(mask, [(0, 0), (0, missing)])
        cross = []
        lanes = cpu.lanes() if lanes is None else lanes
        for i, layer in enumerate(self.decoder.layers):
            with cpu.lane(lanes, i):
                # Stored contiguous: as split_heads' transposed view, every decode step's products would copy
                # them first (a step of Whisper small's shapes over 1,500 positions took 1.9 times as long).
                cross.append(tuple(mx.contiguous(a) for a in layer.cross_attention.project_keys_values(encoder_output)))
        return DecoderCache(cross, padding_bias(mask, encoder_output.dtype))

    def decode(self, tokens: mx.array, cache: DecoderCache) -> mx.array:
        """(B, L) new decoder ids -> (B, L, vocab) logits; appends L positions to the cache."""
        length = tokens.shape[1]
        keys, values = cache.reserve(length)
        step = self.decode_step
        shapes = (tokens.shape, keys[0].shape, cache.cross_keys_values[0][0].shape, cache.cross_bias is None)
        step, cold = self.steps.step_for(shapes, self.decode_step, self.most_traces)
        self.cold_steps += cold
        logits, keys, values = step(tokens, mx.array(cache.offsets), keys, values, cache.cross_keys_values, cache.cross_bias)
        cache.advance(length, keys, values)
        return logits

    def decode_step(self, tokens, offsets, keys, values, cross_keys_values, cross_bias):
        """decode as a function of arrays alone, whose shapes decide its graph:
        tokens (B, L) of rows whose caches hold offsets (B,) positions ->
        logits, and each layer's storage with the new positions written in."""
        B, L = tokens.shape[:2]
        positions = offsets[:, None] + mx.arange(L)
        x = self.shared(tokens.reshape(-1)) if self.decoder.starts else tokens.reshape(B * L, -1)  # (a stage's input)
        x, keys, values = self.decoder(x, positions, keys, values, cross_keys_values, cross_bias)
        if not self.decoder.ends:  # a pipeline stage's hidden states, for the next (pipeline.py)
            return x.reshape(B, L, -1), keys, values
        if self.args.scale_decoder_outputs:
            x = x * self.args.d_model**-0.5
        if self.args.head_tokens:
            logits = self.scored_head(x)
        else:
            logits = self.shared.as_linear(x) if self.args.tie_word_embeddings else self.lm_head(x)
        if self.args.logits_bias:
            logits = logits + self.final_logits_bias
        return logits.reshape(B, L, -1), keys, values

    def cross_attention_weights(self, tokens: mx.array, cache: DecoderCache, layers: set[int]) -> dict:
        """The cross-attention weights (B, H, L, S) of these decoder layers, by layer, in one pass of tokens (B, L)
        from position 0 over `cache`'s cross-attention (speech_tokens.token_times' alignment heads)."""
        return self.capturing_pass(tokens, cache, layers)[1]

    def capturing_pass(self, tokens: mx.array, cache: DecoderCache, layers: set[int]) -> tuple[mx.array, dict]:
        """cross_attention_weights' pass, uncompiled (a compiled step keeps no weights): its output (logits, or a
        stage's hidden states), and the weights."""
        keys, values = cache.reserve(tokens.shape[1])
        with cross_weights(layers) as captured:
            out, _, _ = self.decode_step(tokens, mx.zeros((tokens.shape[0],), mx.int32), keys, values,
                                         cache.cross_keys_values, cache.cross_bias)
        return out, {layer: captured[layer] for layer in layers}

    def scored_head(self, x: mx.array) -> mx.array:
        """A draft's logits over its head's tokens alone (a frequency-ranked subset of the vocabulary, as FR-Spec's
        drafts have): the rest are -inf, never proposed. The target verifies over the whole vocabulary, so what the
        draft leaves out costs acceptance, never exactness; the head's product is a fraction of the full one's."""
        if self._head_columns is None:
            self._head_columns = self.head_columns()
        scored = x @ self._head_columns
        logits = mx.full((*x.shape[:-1], self.args.vocab_size), -mx.inf, scored.dtype)
        return mx.put_along_axis(logits, mx.broadcast_to(self.head_ids, scored.shape), scored, axis=-1)

    def head_columns(self) -> mx.array:
        """The output layer's rows of the head's tokens (the tied embedding's, or lm_head's, dequantized), stored
        as the columns of a (d_model, head_tokens) matrix: a one-row product by it ran 1.6x faster than by the rows'
        transposed view (8,192 of Whisper tiny.en's, MLX 0.32.4's CPU backend)."""
        if self.args.tie_word_embeddings:
            rows = self.shared(self.head_ids)
        elif hasattr(self.lm_head, "scales"):
            head = self.lm_head
            biases = head.get("biases")
            rows = mx.dequantize(head.weight[self.head_ids], head.scales[self.head_ids],
                                 None if biases is None else biases[self.head_ids], head.group_size, head.bits, mode=head.mode)
        else:
            rows = self.lm_head.weight[self.head_ids]
        return mx.contiguous(rows.T)

    def compile_decoding(self) -> "EncoderDecoder":
        """Run decode steps as compiled graphs, traced once per shape (rows,
        new tokens, prompt length rounded up to DecoderCache.prompt_block,
        storage capacity) on the shape's second step: MLX then replays the
        traced graph instead of running the Python that builds it, and fuses
        its elementwise work, which is much of a narrow model's step
        (`python -m bench steps`). A trace costs about a step, and a shape's
        first step runs plainly, a little slower than a replayed one: many
        shapes of a one-shot run, where num-draft auto tries lengths, never
        recur. `cold_steps` counts the steps that did not replay a graph (op
        by op: the first step of each shape).
        After `most_traces` shapes (half a megabyte each for the demo target)
        a long session starts over with none. The weights become constants
        of those graphs, so compile once they are final: changing them with
        update or update_modules turns compilation off again, and after any
        other change (assigning a weight or a layer, patching a function the
        step calls) call this again. Models built directly, as training
        builds them, are not compiled."""
        mx.eval(self.parameters())  # a lazy weight would be recomputed inside every step
        self._head_columns = self.head_columns() if self.args.head_tokens else None
        if self._head_columns is not None:  # taken once, as the weights are final (a borrowed embedding too)
            mx.eval(self._head_columns)
        cpu.prepare(self)  # the CPU path's weight views, made once rather than in every step
        self.steps, self._paused = Traced(self.decode_step), None
        return self

    @property
    def compiled(self) -> bool:
        """Whether decode steps run as compiled graphs (compile_decoding).
        Set False to build every step's graph op by op (what compiling saves:
        `python -m bench steps`), True to compile again."""
        return isinstance(self.steps, Traced)

    @compiled.setter
    def compiled(self, on: bool) -> None:
        if on == self.compiled:
            return
        if not on:  # kept, with its traces, for when it is switched on again
            self._paused, self.steps = self.steps, Plain()
        elif self._paused is not None:
            self.steps, self._paused = self._paused, None
        else:
            self.compile_decoding()

    @property
    def traced_shapes(self) -> int:
        """Decode-step shapes traced into compiled graphs so far."""
        return len(self.steps.traced) if self.compiled else 0

    def update(self, parameters: dict, strict: bool = True) -> "EncoderDecoder":
        self.steps, self._paused, self._head_columns = Plain(), None, None
        return super().update(parameters, strict)

    def update_modules(self, modules: dict, strict: bool = True) -> "EncoderDecoder":
        self.steps, self._paused, self._head_columns = Plain(), None, None
        return super().update_modules(modules, strict)


class Plain:
    """Decode steps run op by op (a model not compiled): the first step of
    each shape is cold (kernels may compile then)."""

    def __init__(self):
        self.run = set()  # the shapes run so far

    def step_for(self, shapes: tuple, step, most: int) -> tuple:
        """The function that runs a step of these shapes, and whether the step is cold."""
        cold = shapes not in self.run
        self.run.add(shapes)
        return step, cold


class Traced:
    """Decode steps as compiled graphs, traced on a shape's second step and
    replayed after: a shape's first step runs plainly (a one-shot run's
    shapes often never recur, and a trace costs about a step). Past `most`
    traced shapes, every trace is dropped and tracing starts again (MLX
    frees them with the compiled function). Every step but a replay is cold."""

    def __init__(self, step):
        self.step, self.compiled = step, mx.compile(step)
        self.traced, self.seen = set(), set()  # the shapes traced so far; the shapes run once, plainly

    def step_for(self, shapes: tuple, step, most: int) -> tuple:
        if shapes in self.traced:
            return self.compiled, False
        if shapes not in self.seen:
            self.seen.add(shapes)
            return step, True
        if len(self.traced) >= most:  # a fresh start
            self.compiled, self.traced = mx.compile(self.step), set()
        self.seen.discard(shapes)
        self.traced.add(shapes)
        return self.compiled, True
