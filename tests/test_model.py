"""model.py against Hugging Face transformers (PyTorch, float32)."""

import numpy as np
import pytest
import torch
from checkpoints import reference_greedy

import mlx.core as mx
from model import KVCache, RelativePositionBias, ModelArgs, load_model, write


def assert_within(ours: mx.array, reference: np.ndarray, tolerance=1e-4) -> None:
    error = np.abs(np.array(ours, dtype=np.float32) - reference).max()
    assert error < tolerance, f"max abs error {error:.2e} (reference scale {np.abs(reference).max():.2f})"


def hf_logits(checkpoint, decoder_ids):
    with torch.no_grad():
        out = checkpoint.hf_model(input_ids=torch.tensor([checkpoint.prompt_ids]), decoder_input_ids=torch.tensor([decoder_ids]))
    return out.logits.numpy()


def test_reference_greedy_output_is_varied_and_well_separated(checkpoint):
    """Guards every equality test: a degenerate fixture would make them vacuous,
    and a near-tie between the top two logits would make them a coin flip."""
    ids = reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 64)
    assert len(ids) == 64 and len(set(ids)) >= 30, ids
    logits = torch.from_numpy(hf_logits(checkpoint, [0] + ids[:-1])[0])
    top2 = logits.topk(2, dim=-1).values
    margin = ((top2[:, 0] - top2[:, 1]) / logits.abs().max(dim=-1).values).min()
    assert margin > 2e-3, f"closest greedy decision wins by {margin:.1e} of the logit scale"


def test_encoder_output_matches_transformers(unit_scale_checkpoint):
    checkpoint = unit_scale_checkpoint
    model = load_model(checkpoint.mlx_dir)
    ours = model.encode(mx.array([checkpoint.prompt_ids]))
    with torch.no_grad():
        ref = checkpoint.hf_model.get_encoder()(input_ids=torch.tensor([checkpoint.prompt_ids])).last_hidden_state.numpy()
    assert_within(ours, ref)


def test_decoder_logits_match_transformers(unit_scale_checkpoint):
    checkpoint = unit_scale_checkpoint
    model = load_model(checkpoint.mlx_dir)
    decoder_ids = [0] + reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 24)
    cache = model.make_cache(model.encode(mx.array([checkpoint.prompt_ids])))
    assert_within(model.decode(mx.array([decoder_ids]), cache), hf_logits(checkpoint, decoder_ids))


def incremental_and_full_logits(checkpoint) -> tuple[list[np.ndarray], np.ndarray]:
    """The logits of 21 tokens decoded one at a time and in chunks of 3 through the cache, and in one pass."""
    model = load_model(checkpoint.mlx_dir)
    encoded = model.encode(mx.array([checkpoint.prompt_ids]))
    ids = [0] + reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 20)
    full = model.decode(mx.array([ids]), model.make_cache(encoded))
    pieces = []
    for chunk in (1, 3):
        cache = model.make_cache(encoded)
        steps = [model.decode(mx.array([ids[i : i + chunk]]), cache) for i in range(0, len(ids), chunk)]
        pieces.append(np.array(mx.concatenate(steps, axis=1)))
    return pieces, np.array(full)


def test_incremental_decoding_equals_full_forward(unit_scale_checkpoint):
    """One token at a time, and chunks of 3, through the cache == one pass over
    all, to float32 precision (a 1-row and a 21-row product may sum in different
    orders: at initializer_factor 10 that alone moves logits past 1e-4)."""
    pieces, full = incremental_and_full_logits(unit_scale_checkpoint)
    for logits in pieces:
        np.testing.assert_allclose(logits, full, rtol=0, atol=1e-4 * np.abs(full).max())


def test_incremental_decoding_picks_the_full_forwards_tokens(checkpoint):
    """On the chaotic (initializer_factor 10) checkpoints, whose greedy choices
    win by more than float32 noise: the same argmax at every position."""
    pieces, full = incremental_and_full_logits(checkpoint)
    for logits in pieces:
        assert (logits.argmax(-1) == full.argmax(-1)).all()


def test_trimmed_cache_gives_logits_of_a_fresh_run(checkpoint):
    """After decoding wrong tokens and trimming them, the cache is as if they never came."""
    model = load_model(checkpoint.mlx_dir)
    encoded = model.encode(mx.array([checkpoint.prompt_ids]))
    ids = [0] + reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 10)
    cache = model.make_cache(encoded)
    model.decode(mx.array([ids[:6]]), cache)
    model.decode(mx.array([[5, 6, 7, 8]]), cache)  # rejected drafts
    cache.trim(4)
    resumed = model.decode(mx.array([ids[6:]]), cache)
    fresh = model.decode(mx.array([ids]), model.make_cache(encoded))[:, 6:]
    np.testing.assert_allclose(np.array(resumed), np.array(fresh), rtol=0, atol=1e-4 * np.abs(np.array(fresh)).max())


def test_padded_batch_matches_single_prompts(checkpoint):
    """A batch padded on the right, with its mask, gives each prompt's own result."""
    model = load_model(checkpoint.mlx_dir)
    short = checkpoint.prompt_ids[:9] + [1]
    long = checkpoint.prompt_ids
    batch = mx.array([long, short + [0] * (len(long) - len(short))])
    mask = mx.array([[1] * len(long), [1] * len(short) + [0] * (len(long) - len(short))])
    encoded = model.encode(batch, mask)
    cache = model.make_cache(encoded, mask)
    logits = model.decode(mx.array([[0, 7, 9], [0, 7, 9]]), cache)
    for row, ids in enumerate([long, short]):
        single_encoded = model.encode(mx.array([ids]))
        single = model.decode(mx.array([[0, 7, 9]]), model.make_cache(single_encoded))
        scale = np.abs(np.array(single)).max()
        np.testing.assert_allclose(np.array(encoded[row, : len(ids)]), np.array(single_encoded[0]), atol=1e-4 * np.abs(np.array(single_encoded)).max())
        np.testing.assert_allclose(np.array(logits[row]), np.array(single[0]), atol=1e-4 * scale)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_match_transformers(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    args = ModelArgs(vocab_size=8, d_model=8, d_kv=2, d_ff=8, num_heads=4, num_layers=1, num_decoder_layers=1)
    ours = RelativePositionBias(args, bidirectional).bucket(mx.arange(-3000, 3000))
    ref = T5Attention._relative_position_bucket(torch.arange(-3000, 3000), bidirectional, 32, 128)
    np.testing.assert_array_equal(np.array(ours), ref.numpy())


def append(cache: KVCache, new: mx.array) -> None:
    """What a decode step does to one layer's cache: room, the write, the new lengths."""
    cache.reserve(new.shape[2], new.shape[1], new.shape[3], new.dtype)
    positions = mx.array(cache.offsets)[:, None] + mx.arange(new.shape[2])
    cache.advance(new.shape[2], write(cache.keys, positions, new), write(cache.values, positions, new))


def test_kv_cache_grows_a_block_at_a_time_and_overwrites_trimmed_positions():
    """A step's shapes (and so its compiled graph) change once a block, not every token."""
    cache = KVCache()
    capacities = set()
    for _ in range(300):
        append(cache, mx.ones((1, 2, 1, 4)))
        capacities.add(cache.capacity)
    assert cache.offset == 300
    assert capacities == {KVCache.block * n for n in range(1, -(-300 // KVCache.block) + 1)}
    cache.trim(5)
    assert cache.offset == 295
    append(cache, mx.zeros((1, 2, 1, 4)))
    assert cache.offset == 296 and float(cache.keys[..., 295, :].sum()) == 0 and float(cache.keys[..., 294, :].min()) == 1


def test_compiled_decoding_equals_the_graph_built_op_by_op(checkpoint):
    """load_model compiles decode steps; the same steps uncompiled give the
    same logits (to rounding) and the same greedy tokens."""
    model = load_model(checkpoint.mlx_dir)
    assert model._compiled_step is not None
    encoded = model.encode(mx.array([checkpoint.prompt_ids]))
    ids = [0] + reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 20)
    outputs = []
    for compiled in (model._compiled_step, None):
        model._compiled_step = compiled
        cache = model.make_cache(encoded)
        outputs.append(mx.concatenate([model.decode(mx.array([ids[i : i + 3]]), cache) for i in range(0, len(ids), 3)], axis=1))
    compiled, plain = (np.array(x) for x in outputs)
    np.testing.assert_allclose(compiled, plain, rtol=0, atol=1e-5 * np.abs(plain).max())
    assert (compiled.argmax(-1) == plain.argmax(-1)).all()


def test_changing_the_weights_of_a_compiled_model_is_not_ignored(checkpoint):
    """Compiled steps hold the weights as constants: an update must switch them off."""
    model = load_model(checkpoint.mlx_dir)
    prompt = mx.array([checkpoint.prompt_ids])
    before = model.decode(mx.array([[0]]), model.make_cache(model.encode(prompt)))
    model.update({"shared": {"weight": model.shared.weight * 2}})
    assert model._compiled_step is None
    after = model.decode(mx.array([[0]]), model.make_cache(model.encode(prompt)))
    assert not np.allclose(np.array(before), np.array(after))


def test_a_long_session_keeps_a_bounded_number_of_compiled_steps(checkpoint):
    """Each new shape (here, prompt length) traces a graph; past most_traces
    they are dropped and tracing starts over, with the same logits."""
    model = load_model(checkpoint.mlx_dir)
    model.most_traces = 3
    for length in range(4, 10):
        prompt = mx.array([checkpoint.prompt_ids[:length - 1] + [1]])
        compiled = model.decode(mx.array([[0, 5]]), model.make_cache(model.encode(prompt)))
        assert 1 <= len(model._traced) <= 3
        plain = model.decode_step(mx.array([[0, 5]]), *model_inputs(model, prompt))[0]
        np.testing.assert_allclose(np.array(compiled), np.array(plain), rtol=0, atol=1e-5 * float(mx.abs(plain).max()))


def model_inputs(model, prompt: mx.array) -> tuple:
    """decode_step's arguments after `prompt` is encoded, for two new tokens."""
    cache = model.make_cache(model.encode(prompt))
    keys, values = cache.reserve(2)
    return mx.array(cache.offsets), keys, values, cache.cross_keys_values, cache.cross_bias


@pytest.fixture(scope="module")
def unit_scale_v1_0(tmp_path_factory, tokenizer_dir, tokenizer):
    import conftest

    return conftest.build("v1_0_tied", tmp_path_factory, tokenizer_dir, tokenizer, initializer_factor=1.0)


BLOCK = 8


@pytest.mark.parametrize("length", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1])
@pytest.mark.parametrize("lanes", [0, 2])
def test_encoding_in_blocks_of_queries_equals_transformers_with_padding(unit_scale_v1_0, monkeypatch, length, lanes):
    """Chunks of 16 rows, attention in blocks of 8 queries and one head with our
    own softmax, at lengths around the block sizes, with the position bias cut
    per block and a padded second row; on one stream or two."""
    import model as t5

    monkeypatch.setattr(t5, "row_chunks", lambda L, n: [(a, min(a + 2 * BLOCK, L)) for a in range(0, L, 2 * BLOCK)])
    monkeypatch.setattr(t5, "attention_blocks", lambda first, last, heads, keys: [
        (a, min(a + BLOCK, last), h, h + 1) for a in range(first, last, BLOCK) for h in range(heads)])
    ours_model = load_model(unit_scale_v1_0.mlx_dir)
    ours_model.lanes = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))[:lanes]
    rng = np.random.default_rng(length)
    ids = rng.integers(3, 1000, size=(2, length))
    ids[:, -1] = 1
    mask = np.ones_like(ids)
    mask[1, max(1, length - 3):] = 0  # the second prompt is shorter, padded on the right
    ours = ours_model.encode(mx.array(ids), mx.array(mask))
    with torch.no_grad():
        ref = unit_scale_v1_0.hf_model.get_encoder()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    for row in range(2):
        valid = mask[row].astype(bool)
        assert_within(ours[row][mx.array(np.flatnonzero(valid))], ref[row][valid])


def test_chunks_and_blocks_cover_the_input_bound_the_scores_and_give_every_lane_work():
    """Chunks tile the rows; blocks tile each chunk's rows and all heads, within the score budget."""
    from model import ROWS_PER_BLOCK, ROWS_PER_CHUNK, SCORES_PER_BLOCK, attention_blocks, row_chunks

    def tile(pieces, first, last):
        return pieces[0][0] == first and pieces[-1][1] == last and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))

    for length in (1, 53, 512, 2049, 8192, 100_000):
        for heads, lanes in ((4, 0), (16, 2), (128, 4)):
            chunks = row_chunks(length, lanes)
            assert tile(chunks, 0, length)
            assert max(last - first for first, last in chunks) <= ROWS_PER_CHUNK
            assert len(chunks) >= min(max(1, lanes), length)
            for first, last in chunks:
                blocks = attention_blocks(first, last, heads, length)
                by_rows = sorted({(a, b) for a, b, _, _ in blocks})
                assert tile(by_rows, first, last)
                for a, b in by_rows:
                    assert tile(sorted((h, g) for a2, _, h, g in blocks if a2 == a), 0, heads)
                for a, b, h, g in blocks:
                    scores = (b - a) * (g - h) * length
                    assert scores <= SCORES_PER_BLOCK or (g - h == 1 and b - a <= ROWS_PER_BLOCK)
                    assert b - a >= min(ROWS_PER_BLOCK, last - a)  # enough rows for fast products


def test_our_exp_below_zero_is_exp_to_float32_precision():
    """Over [-87, 0] within 2e-7 of exp, absolute, and 3e-7 * (1 + |x|)
    relative (x / ln 2 in float32 carries x's size into the error); 0 below
    (and at -inf, a padded key); half precision kept; exp's gradient."""
    from model import exp_below_zero

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


def test_chunks_of_one_attention_block_still_spread_over_every_lane(unit_scale_v1_0, monkeypatch):
    """A 64-token prompt on two lanes is two chunks of one attention block
    each: the two blocks of every layer run on different lanes (they once all
    took the first, and a 512-token prompt ran on one core)."""
    import model as t5

    ours_model = load_model(unit_scale_v1_0.mlx_dir)
    ours_model.lanes = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))
    heads = ours_model.encoder.layers[0].attention.num_heads
    assert [len(t5.attention_blocks(a, b, heads, 64)) for a, b in t5.row_chunks(64, 2)] == [1, 1]
    streams, attend = [], t5.attend

    def recording(*args, **kwargs):
        streams.append(mx.default_stream(mx.cpu))
        return attend(*args, **kwargs)

    monkeypatch.setattr(t5, "attend", recording)
    mx.eval(ours_model.encode(mx.array([[5] * 63 + [1]])))
    layers = len(ours_model.encoder.layers)
    assert len(streams) == 2 * layers
    assert all(streams[2 * i] != streams[2 * i + 1] for i in range(layers))


@pytest.mark.parametrize("padded", [False, True])
def test_our_cpu_softmax_attention_equals_the_fused_kernel(padded):
    """The CPU path for queries with many keys (our exp, normalised after the
    values, by a sum or by a column of ones) agrees with MLX's fused
    attention, -inf padding included."""
    from model import OWN_SOFTMAX_FROM, attend, with_summing_column

    rng = np.random.default_rng(0)
    queries, keys, values = (mx.array(rng.normal(size=(2, 4, n, 16)).astype(np.float32) * 2) for n in (40, 1100, 1100))
    bias = mx.array(rng.normal(size=(1, 4, 40, 1100)).astype(np.float32) * 5)
    if padded:
        bias = bias + mx.where(mx.arange(1100) < 1000, 0.0, -mx.inf)[None, None, None, :]
    assert 4 * 1100 >= OWN_SOFTMAX_FROM  # many enough keys for cross-attention's rule to take our path
    fused = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=bias)
    for softmax in ("ours", "by-keys"):
        np.testing.assert_allclose(np.array(attend(queries, keys, values, bias, softmax)), np.array(fused), rtol=1e-5, atol=1e-5)
    # The encoder's form: the normaliser from a column of ones on the values.
    summed = attend(queries, keys, with_summing_column(values), bias, "ours", summing_column=True)
    np.testing.assert_allclose(np.array(summed), np.array(fused), rtol=1e-5, atol=1e-5)
    # A short prompt's 60 keys, which the encoder's attention takes our path for too.
    few = (keys[:, :, :60], values[:, :, :60])
    np.testing.assert_allclose(np.array(attend(queries, *few, bias[..., :60], "ours")),
                               np.array(mx.fast.scaled_dot_product_attention(queries, *few, scale=1.0, mask=bias[..., :60])),
                               rtol=1e-5, atol=1e-5)


MEMORY_PROBE = r"""
import re, resource, sys
from pathlib import Path
from decoder import start_decoding  # before mlx.core, through cpu.py: the fast BLAS
from model import load_model

def peak():  # bytes. Linux's ru_maxrss counts the parent's memory from before the exec: VmHWM does not
    if sys.platform == "darwin":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024

model = load_model("demo/target")
start_decoding(model, list(range(3, 67)))  # warm-up: buffers, kernels
before = peak()
start_decoding(model, [(i * 7919) % 1000 + 3 for i in range(8191)] + [1])
print(before, peak())
"""


def test_a_long_prompt_encodes_in_less_memory_than_one_full_score_matrix():
    """The demo target given 8,192 tokens: a full (heads, L, L) float32 score
    matrix alone would take 1.07 GB; encoding in blocks must grow the process's
    peak resident memory by less than that, and the whole process must stay
    under 1.5 GB (measured in a fresh process)."""
    import subprocess
    import sys

    from conftest import ROOT

    heads, length = 4, 8192
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    before, after = map(int, done.stdout.split()[-2:])
    assert after - before < heads * length * length * 4, f"peak grew by {(after - before) / 1e6:.0f} MB"
    assert after < 1.5e9, f"peak {after / 1e9:.2f} GB"
