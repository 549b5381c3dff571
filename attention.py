"""T5's attention as each path computes it: `attend`, the one entry point.

Every attention in model.py comes here, naming which it is:
- "self": the decoder's queries over its own cache;
- "cross": the decoder's queries over the prompt's keys and values;
- "prompt": the encoder's queries (a chunk of a long input's rows) over the
  whole input, its bias given as a function of rows.

Scale 1: T5 folds 1/sqrt(d_kv) into its initialisation. On the accelerator
path (cpu.in_use() False), MLX's fused kernel. On the CPU path, where MLX's
fused attention is built of plain operations anyway, our own: the bias added
in the scores' product (mx.addmm), no scaling by 1, and, where a query has
many keys, an exponential of our own (~6 ns a score for a whole block where
MLX's fused attention costs ~13 on x86: python -m bench attention).

A prompt's self-attention goes in blocks of queries and heads on both paths,
so that its memory grows with the input's length, not with its square: each
block's scores (8 MB of float32) are reused memory, not pages fresh from
the OS (cpu.py), and keep at least 32 queries, below which the products run
at half speed. MLX evaluates up to ~20 independent blocks side by side, so
this also sets the memory attention takes whatever the length (~0.5 GB).
"""

import math

import cpu  # before mlx.core
import mlx.core as mx

SCORES_PER_BLOCK = 1 << 21
CROSS_WEIGHTS: dict | None = None  # while captured (cross_weights): layer -> its cross-attention's weights
ROWS_PER_BLOCK = 32  # at least
OWN_SOFTMAX_FROM = 4096  # scores per query (heads x keys) from which cross-attention takes our softmax


def attend(queries: mx.array, keys: mx.array, values: mx.array, bias, kind: str, lanes: tuple = ()) -> mx.array:
    """Softmax attention of queries (B, H, L, D) over keys and values
    (B, H, S, D), plus an additive bias: (B or 1, H or 1, L, S) for "self"
    and "cross" (None: no bias), and for "prompt" a function bias_of(first,
    last) giving rows first..last-1 of it (or None), whose blocks take the
    `lanes` in turn, and the values as prompt_values gives them. Returns
    (B, H, L, D).

    On the CPU path, the decoder's self-attention takes MLX's softmax (its
    keys grow step by step: a rule on their count would switch in a verify
    pass at a different step than in a regular one); cross-attention takes
    ours when each query scores OWN_SOFTMAX_FROM keys x heads or more (a
    long prompt), a rule on each query's own scores, never on how many
    queries come, so a row gets the same arithmetic alone or in a verify
    pass; the encoder takes ours, whose normaliser comes out of the values'
    product through a column of ones."""
    assert kind in ("self", "cross", "prompt"), kind
    if kind == "prompt":
        return attend_in_blocks(queries, keys, values, bias, lanes)
    if kind == "cross" and CROSS_WEIGHTS is not None:
        transposed = keys.swapaxes(-1, -2)
        weights = mx.softmax(queries @ transposed if bias is None else mx.addmm(bias, queries, transposed), axis=-1,
                             precise=True)
        layer = CROSS_WEIGHTS["next"] = CROSS_WEIGHTS.get("next", -1) + 1
        if layer in CROSS_WEIGHTS["layers"]:
            CROSS_WEIGHTS[layer] = weights
        return weights @ values
    if not cpu.in_use():
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=bias)
    H, S = queries.shape[1], keys.shape[2]
    own = kind == "cross" and H * S >= OWN_SOFTMAX_FROM
    return softmax_attention(queries, keys, values, bias, own)


class cross_weights:
    """A context in which the cross-attention of these decoder layers keeps
    its weights (B, H, L, S), by layer: `with cross_weights({2, 5}) as
    captured: model.decode_step(...)`, then captured[2] (uncompiled: a
    compiled step keeps nothing). Only the engine's thread runs MLX: one
    capture at a time."""

    def __init__(self, layers: set[int]):
        self.layers = set(layers)

    def __enter__(self) -> dict:
        global CROSS_WEIGHTS
        CROSS_WEIGHTS = {"layers": self.layers}
        return CROSS_WEIGHTS

    def __exit__(self, *exc) -> None:
        global CROSS_WEIGHTS
        CROSS_WEIGHTS = None


def attend_in_blocks(queries, keys, values, bias_of, lanes: tuple) -> mx.array:
    """The encoder's attention, block by block (attention_blocks). The
    blocks take the lanes in turn: MLX runs a graph's operations in about
    the order they were built, a bounded number ahead, so blocks that all
    ran on one lane would keep the other cores idle."""
    B, H, L, _ = queries.shape
    on_cpu = cpu.in_use()
    rows = {}  # first row -> that block's output, head group by head group
    for i, (a, b, h, g) in enumerate(attention_blocks(L, H, keys.shape[2])):
        with cpu.lane(lanes, i):  # the slices too: a block's every operation on its own lane
            q, k, v, bias = queries[:, h:g, a:b], keys[:, h:g], values[:, h:g], bias_of(a, b)
            bias = None if bias is None else bias[:, h:g]
            if on_cpu:
                out = softmax_attention(q, k, v, bias, own=True, summing_column=True)
            else:
                out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=bias)
        rows.setdefault(a, []).append(out)
    return mx.concatenate([mx.concatenate(heads, axis=1) for heads in rows.values()], axis=2)


def attention_blocks(rows: int, heads: int, keys: int) -> list[tuple[int, int, int, int]]:
    """(first row, last row, first head, last head) blocks covering `rows`
    queries and every head, each with at most SCORES_PER_BLOCK scores (or
    ROWS_PER_BLOCK rows of one head, when a row alone has more)."""
    size = min(rows, block_rows(heads, keys))
    group = max(1, min(heads, SCORES_PER_BLOCK // (size * keys)))
    return [(a, min(a + size, rows), h, min(h + group, heads))
            for a in range(0, rows, size) for h in range(0, heads, group)]


def block_rows(heads: int, keys: int) -> int:
    """The most queries a block takes over `keys` keys: every head's scores within SCORES_PER_BLOCK, or ROWS_PER_BLOCK."""
    return max(ROWS_PER_BLOCK, SCORES_PER_BLOCK // (heads * keys))


def softmax_attention(queries, keys, values, bias, own: bool, summing_column: bool = False) -> mx.array:
    """The CPU path's attention: MLX's softmax, or (own) our exponential,
    which costs a few operations more and pays once a call has tens of
    queries or a query many keys. With `summing_column` the values end in a
    column of ones (with_summing_column), which gives the normaliser."""
    transposed = keys.swapaxes(-1, -2)
    scores = queries @ transposed if bias is None else mx.addmm(bias, queries, transposed)
    if not own:
        return mx.softmax(scores, axis=-1, precise=True) @ values
    weights = exp_below_top(scores, scores.max(axis=-1, keepdims=True))
    if summing_column:
        out = weights @ values
        return out[..., :-1] / out[..., -1:]
    return (weights @ values) / weights.sum(axis=-1, keepdims=True)


def prompt_values(values: mx.array) -> mx.array:
    """A long input's values as its attention ("prompt") takes them: on the CPU path, with_summing_column's. Made once
    for all of a layer's queries: made for each span of them, the copy of every value cost an 8,193-token prompt on
    the demo target a third of its encoding's time."""
    return with_summing_column(values) if cpu.in_use() else values


def with_summing_column(values: mx.array) -> mx.array:
    """values (..., keys, d) with a column of ones appended: the weights'
    product with them is then the weighted values and, in the last column,
    the weights' sum, in one product (a sum of its own costs ~1 ns a score)."""
    return mx.concatenate([values, mx.ones((*values.shape[:-1], 1), values.dtype)], axis=-1)


# 2**f for f in [-0.5, 0.5]: its Taylor series to degree 6 (error below 2e-7).
_EXP2_TERMS = [math.log(2) ** k / math.factorial(k) for k in range(7)]

# exp(x) for x <= 0 is 2**y, y = x / ln 2: 2**n * 2**f, n the integer nearest
# y and f = y - n in [-0.5, 0.5]; 2**n is put into a float's exponent bits and
# 2**f is a polynomial. MLX's CPU compile fuses elementwise operations into
# one C++ loop, but cuts the graph at a bit cast (view) and 11 operations
# deep, and every cut is another pass over memory; a scalar at a cut also
# turns the loop into an indexing one. So the work is two compiled halves,
# each at most 10 operations deep, with the bit cast between (python -m bench
# attention times it against MLX's exp). No floor: built without SSE4.1 it is
# a library call per element; a cast to integer truncates, toward 0. Not
# shapeless: MLX's shapeless tracing adds broadcasts that cut the graph again.


def _scaled_and_exponent_bits(x: mx.array, top: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """y = (x - top) / ln 2, and the float bits of 2**n; below x - top = -87
    (where float32 runs out of exponents) the bits of 0, as MLX's exp gives.
    In float32 whatever x's type: half precision would lose digits in y."""
    x = x.astype(mx.float32) if top is None else x.astype(mx.float32) - top.astype(mx.float32)
    y = mx.maximum(x, -87.0) * (1 / math.log(2))
    n = (y - 0.5).astype(mx.int32)  # the integer nearest y (y <= 0: the cast rounds toward zero)
    return y, mx.where(x >= -87.0, (n + 127) << 23, 0)


def _times_exp2_fraction(y: mx.array, power_of_two: mx.array) -> mx.array:
    """2**n * 2**f, the polynomial in Estrin's order (shallower than Horner's,
    so that the whole half fuses)."""
    f = y - (y - 0.5).astype(mx.int32).astype(y.dtype)
    f2 = f * f
    c = _EXP2_TERMS
    return (c[0] + c[1] * f + f2 * (c[2] + c[3] * f) + (f2 * f2) * (c[4] + c[5] * f + f2 * c[6])) * power_of_two


# Without a C++ compiler (MLX's CPU compile runs g++), MLX evaluates them op by op. The first half also comes with
# the subtraction of each row's maximum in its loop: one pass over the scores less.
_compiled_halves = (mx.compile(_scaled_and_exponent_bits), mx.compile(_times_exp2_fraction))
_compiled_below_top = mx.compile(lambda x, top: _scaled_and_exponent_bits(x, top))


def _exp_below_zero(x: mx.array) -> mx.array:
    first, second = _compiled_halves
    y, bits = first(x)
    return second(y, bits.view(mx.float32)).astype(x.dtype)  # half stays half


@mx.custom_function
def exp_below_zero(x: mx.array) -> mx.array:
    """exp(x) for x <= 0 to float32 precision, at a fraction of MLX's exp's
    cost on the CPU; with exp's gradient: the bit cast has none, and training
    runs the encoder's attention through it."""
    return _exp_below_zero(x)


@exp_below_zero.vjp
def _exp_below_zero_vjp(primals, cotangent, output):
    return cotangent * output


@mx.custom_function
def exp_below_top(x: mx.array, top: mx.array) -> mx.array:
    """exp(x - top) for x <= top, top (..., 1) each row's maximum (or more) along the last axis: exp_below_zero with
    the subtraction in its first loop."""
    y, bits = _compiled_below_top(x, top)
    return _compiled_halves[1](y, bits.view(mx.float32)).astype(x.dtype)


@exp_below_top.vjp
def _exp_below_top_vjp(primals, cotangent, output):
    x, top = primals
    along = cotangent * output
    # top's share: summed over the axes it was broadcast along (its own shape, whatever its rank)
    broadcast = tuple(axis for axis in range(along.ndim)
                      if axis < along.ndim - top.ndim or top.shape[axis - (along.ndim - top.ndim)] == 1 != along.shape[axis])
    return along, (-along.sum(axis=broadcast, keepdims=True)).reshape(top.shape)
