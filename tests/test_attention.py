"""attention.py: our CPU attention against MLX's fused kernel, its exponential, and how a prompt's work is cut."""

import numpy as np
import pytest

import attention
import cpu
import mlx.core as mx
from attention import (OWN_SOFTMAX_FROM, ROWS_PER_BLOCK, SCORES_PER_BLOCK, attend, attention_blocks, exp_below_top,
                       exp_below_zero, prompt_values)
from conftest import ROOT
from loading import load_model
from model import ROWS_PER_CHUNK, row_chunks

cpu_path_only = pytest.mark.skipif(not cpu.in_use(), reason="the CPU path's own arithmetic and lanes")


def test_chunks_and_blocks_cover_the_input_bound_the_scores_and_give_every_lane_work():
    """Chunks tile the rows; blocks tile each chunk's rows and all heads, within the score budget."""

    def tile(pieces, first, last):
        return pieces[0][0] == first and pieces[-1][1] == last and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))

    for length in (1, 53, 512, 2049, 8192, 100_000):
        for heads, lanes in ((4, 0), (16, 2), (128, 4)):
            chunks = row_chunks(length, lanes)
            assert tile(chunks, 0, length)
            assert max(last - first for first, last in chunks) <= ROWS_PER_CHUNK
            assert len(chunks) >= min(max(1, lanes), length)
            for first, last in chunks:
                blocks = attention_blocks(last - first, heads, length)
                by_rows = sorted({(a, b) for a, b, _, _ in blocks})
                assert tile(by_rows, 0, last - first)
                for a, b in by_rows:
                    assert tile(sorted((h, g) for a2, _, h, g in blocks if a2 == a), 0, heads)
                for a, b, h, g in blocks:
                    scores = (b - a) * (g - h) * length
                    assert scores <= SCORES_PER_BLOCK or (g - h == 1 and b - a <= ROWS_PER_BLOCK)
                    assert b - a >= min(ROWS_PER_BLOCK, last - first - a)  # enough rows for fast products


def test_our_exp_below_zero_is_exp_to_float32_precision():
    """Over [-87, 0] within 2e-7 of exp, absolute, and 3e-7 * (1 + |x|)
    relative (x / ln 2 in float32 carries x's size into the error); 0 below
    (and at -inf, a padded key); half precision kept; exp's gradient."""
    x = mx.array(np.concatenate([-np.logspace(-8, np.log10(87), 100_000), [0.0, -0.5, -1.5, -87.0]]), dtype=mx.float32)
    ours, ref = np.array(exp_below_zero(x)), np.exp(np.array(x, dtype=np.float64))
    assert np.max(np.abs(ours - ref)) < 2e-7
    assert np.max(np.abs(ours - ref) / ref / (1 + np.abs(np.array(x)))) < 3e-7
    assert np.array(exp_below_zero(mx.array([-87.01, -100.0, -1e30, -np.inf]))).tolist() == [0.0] * 4
    half = exp_below_zero(mx.array([-0.25, -3.0], dtype=mx.float16))
    assert half.dtype == mx.float16 and np.allclose(np.array(half), np.exp([-0.25, -3.0]), rtol=1e-3)
    x16 = mx.array(-np.linspace(0, 9, 1000), dtype=mx.float16)  # results normal in half: within one unit of it
    assert np.max(np.abs(np.array(exp_below_zero(x16), np.float64) / np.exp(np.array(x16, np.float64)) - 1)) < 2**-10
    gradient = mx.grad(lambda v: exp_below_zero(v).sum())(mx.array([-1.0, -2.0]))
    assert np.allclose(np.array(gradient), np.exp([-1.0, -2.0]), rtol=1e-6)



def test_exp_below_top_is_exp_of_the_difference_and_softmax_has_its_gradient():
    """exp(x - top) as exp_below_zero(x - top) gives it, padding (-inf) to 0; and a softmax built on it, with top the
    rows' maximum, has the softmax's gradient (the maximum's share cancels)."""
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(0, 8, (6, 300)).astype(np.float32))
    x = mx.where(mx.arange(300) < 280, x, -mx.inf)  # padded keys
    top = x.max(axis=-1, keepdims=True)
    assert np.array_equal(np.array(exp_below_top(x, top)), np.array(exp_below_zero(x - top)))

    def ours(v):
        weights = exp_below_top(v, v.max(axis=-1, keepdims=True))
        return weights / weights.sum(axis=-1, keepdims=True)

    probe = mx.array(rng.normal(0, 1, (6, 300)).astype(np.float32))
    for name, soft in (("ours", ours), ("mlx", lambda v: mx.softmax(v, axis=-1, precise=True))):
        gradient = mx.grad(lambda v, soft=soft: (soft(v) * probe[:, :280]).sum())(x[:, :280])
        if name == "ours":
            mine = np.array(gradient)
        else:
            np.testing.assert_allclose(mine, np.array(gradient), atol=1e-6)


@pytest.fixture(scope="module")
def attention_inputs():
    rng = np.random.default_rng(0)
    queries, keys, values = (mx.array(rng.normal(size=(2, 4, n, 16)).astype(np.float32) * 2) for n in (40, 1100, 1100))
    bias = mx.array(rng.normal(size=(1, 4, 40, 1100)).astype(np.float32) * 5)
    return queries, keys, values, bias


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind, own_exp", [("self", False), ("cross", True), ("prompt", True)])
def test_every_kind_of_attention_equals_the_fused_kernel(attention_inputs, padded, kind, own_exp, monkeypatch):
    """Each kind agrees with MLX's fused attention, -inf padding included; on
    the CPU path self-attention takes MLX's softmax, cross-attention over this
    many keys and the prompt's blocks our exponential (the prompt's
    normalised by a column of ones). The prompt's, here cut into blocks of 8
    queries and one head with the bias given row by row, is checked on the
    accelerator path too; the other two are the fused kernel there."""
    if kind != "prompt" and not cpu.in_use():
        pytest.skip("the fused kernel itself on the accelerator path")
    queries, keys, values, bias = attention_inputs
    if padded:
        bias = bias + mx.where(mx.arange(1100) < 1000, 0.0, -mx.inf)[None, None, None, :]
    assert 4 * 1100 >= OWN_SOFTMAX_FROM  # many enough keys for cross-attention's rule to take our path
    fused = np.array(mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=bias))
    calls, real = [], attention.exp_below_top
    monkeypatch.setattr(attention, "exp_below_top", lambda x, top: calls.append(1) or real(x, top))
    if kind == "prompt":
        monkeypatch.setattr(attention, "attention_blocks", lambda rows, heads, _: [
            (a, min(a + 8, rows), h, h + 1) for a in range(0, rows, 8) for h in range(heads)])
        ours = attend(queries, keys, prompt_values(values), lambda a, b: bias[:, :, a:b], "prompt")
    else:
        ours = attend(queries, keys, values, bias, kind)
    np.testing.assert_allclose(np.array(ours), fused, rtol=1e-5, atol=1e-5)
    assert bool(calls) == (own_exp and cpu.in_use())


def test_a_short_prompts_attention_equals_the_fused_kernel(attention_inputs):
    """60 keys: the encoder's blocks take our exponential at any length."""
    queries, keys, values, bias = attention_inputs
    few = (keys[:, :, :60], values[:, :, :60])
    ours = attend(queries, few[0], prompt_values(few[1]), lambda a, b: bias[:, :, a:b, :60], "prompt")
    np.testing.assert_allclose(np.array(ours),
                               np.array(mx.fast.scaled_dot_product_attention(queries, *few, scale=1.0, mask=bias[..., :60])),
                               rtol=1e-5, atol=1e-5)


@cpu_path_only
def test_chunks_of_one_attention_block_still_spread_over_every_lane(monkeypatch):
    """A 64-token prompt on two lanes is two chunks of one attention block
    each: the two blocks of every layer run on different lanes (they once all
    took the first, and a 512-token prompt ran on one core)."""
    model = load_model(ROOT / "demo" / "target")
    lanes = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))
    heads = model.encoder.layers[0].attention.num_heads
    assert [len(attention_blocks(b - a, heads, 64)) for a, b in row_chunks(64, 2)] == [1, 1]
    streams, real = [], attention.softmax_attention

    def recording(*args, **kwargs):
        streams.append(mx.default_stream(mx.cpu))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "softmax_attention", recording)
    mx.eval(model.encode(mx.array([[5] * 63 + [1]]), lanes=lanes))
    layers = len(model.encoder.layers)
    assert len(streams) == 2 * layers
    assert all(streams[2 * i] != streams[2 * i + 1] for i in range(layers))
