"""model.py against Hugging Face transformers (PyTorch, float32)."""

import numpy as np
import pytest
import torch
from checkpoints import reference_greedy
from support import assert_as_near_as_transformers, farthest_float32, in_float64

import cpu
import mlx.core as mx
from loading import load_model
from cache import DecoderCache, KVCache, write
from model import ModelArgs, RelativePositionBias


def hf_logits(checkpoint, decoder_ids, model=None):
    with torch.no_grad():
        out = (model or checkpoint.hf_model)(input_ids=torch.tensor([checkpoint.prompt_ids]),
                                             decoder_input_ids=torch.tensor([decoder_ids]))
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


@pytest.mark.parametrize("scale", ["unit", "chaotic"])
def test_encoder_output_matches_transformers(unit_scale_checkpoint, checkpoint_by_name, scale):
    """As near float64 as transformers' own float32 comes (support.assert_as_near_as_transformers); on a chaotic
    fixture, as its float32 may come by chance (checkpoints.farthest_float32)."""
    checkpoint = unit_scale_checkpoint if scale == "unit" else checkpoint_by_name(unit_scale_checkpoint.name)
    model = load_model(checkpoint.mlx_dir)
    ours = model.encode(mx.array([checkpoint.prompt_ids]))

    def encoded(m):
        with torch.no_grad():
            return m.get_encoder()(input_ids=torch.tensor([checkpoint.prompt_ids])).last_hidden_state.numpy()

    exact = encoded(in_float64(checkpoint.hf_model))
    chance = farthest_float32(checkpoint.hf_model, encoded, exact) if scale == "chaotic" else None
    assert_as_near_as_transformers(np.array(ours), encoded(checkpoint.hf_model), exact, "encoder output", chance=chance)


@pytest.mark.parametrize("scale", ["unit", "chaotic"])
def test_decoder_logits_match_transformers(unit_scale_checkpoint, checkpoint_by_name, scale):
    checkpoint = unit_scale_checkpoint if scale == "unit" else checkpoint_by_name(unit_scale_checkpoint.name)
    model = load_model(checkpoint.mlx_dir)
    decoder_ids = [0] + reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 24)
    cache = model.make_cache(model.encode(mx.array([checkpoint.prompt_ids])))
    exact = hf_logits(checkpoint, decoder_ids, in_float64(checkpoint.hf_model))
    chance = farthest_float32(checkpoint.hf_model, lambda m: hf_logits(checkpoint, decoder_ids, m), exact) \
        if scale == "chaotic" else None
    assert_as_near_as_transformers(np.array(model.decode(mx.array([decoder_ids]), cache)), hf_logits(checkpoint, decoder_ids),
                                   exact, chance=chance)


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
        np.testing.assert_allclose(np.array(encoded[row, : len(ids)]), np.array(single_encoded[0]),
                                   atol=1e-4 * np.abs(np.array(single_encoded)).max())
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
    """load_model compiles decode steps (decode); the same steps run op by op
    (decode_step, which decode compiles) give the same logits (to rounding)
    and the same greedy tokens, three tokens at a time through the cache."""
    model = load_model(checkpoint.mlx_dir)
    assert model.compiled
    encoded = model.encode(mx.array([checkpoint.prompt_ids]))
    ids = [0] + reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 20)
    chunks = [mx.array([ids[i : i + 3]]) for i in range(0, len(ids), 3)]
    cache = model.make_cache(encoded)
    compiled = np.array(mx.concatenate([model.decode(tokens, cache) for tokens in chunks], axis=1))
    cache, steps = model.make_cache(encoded), []
    for tokens in chunks:
        keys, values = cache.reserve(tokens.shape[1])
        logits, keys, values = model.decode_step(tokens, mx.array(cache.offsets), keys, values,
                                                 cache.cross_keys_values, cache.cross_bias)
        cache.advance(tokens.shape[1], keys, values)
        steps.append(logits)
    plain = np.array(mx.concatenate(steps, axis=1))
    np.testing.assert_allclose(compiled, plain, rtol=0, atol=1e-5 * np.abs(plain).max())
    assert (compiled.argmax(-1) == plain.argmax(-1)).all()


def test_changing_the_weights_of_a_compiled_model_is_not_ignored(checkpoint):
    """Compiled steps hold the weights as constants: an update must switch them off."""
    model = load_model(checkpoint.mlx_dir)
    prompt = mx.array([checkpoint.prompt_ids])
    before = model.decode(mx.array([[0]]), model.make_cache(model.encode(prompt)))
    model.update({"shared": {"weight": model.shared.weight * 2}})
    assert not model.compiled
    after = model.decode(mx.array([[0]]), model.make_cache(model.encode(prompt)))
    assert not np.allclose(np.array(before), np.array(after))


def test_a_long_session_keeps_a_bounded_number_of_compiled_steps(checkpoint):
    """A shape (here, tokens a step) runs plainly its first time and traces a
    graph its second; past most_traces the graphs are dropped and tracing
    starts over, with the same logits."""
    model = load_model(checkpoint.mlx_dir)
    model.most_traces = 3
    prompt = mx.array([checkpoint.prompt_ids])
    for length in range(1, 7):
        tokens = mx.array([[0, 5, 9, 13, 17, 21][:length]])
        first = model.decode(tokens, model.make_cache(model.encode(prompt)))
        traced_before = (length - 2) % model.most_traces + 1 if length > 1 else 0  # a first run traces nothing
        assert model.traced_shapes == traced_before
        compiled = model.decode(tokens, model.make_cache(model.encode(prompt)))
        assert model.traced_shapes == (length - 1) % model.most_traces + 1
        plain = model.decode_step(tokens, *model_inputs(model, prompt, length))[0]
        for logits in (first, compiled):
            np.testing.assert_allclose(np.array(logits), np.array(plain), rtol=0, atol=1e-5 * float(mx.abs(plain).max()))


def test_prompts_of_about_one_length_share_compiled_steps(checkpoint):
    """The cache keeps a prompt's positions in blocks, the padding masked:
    prompts whose lengths fall in one block trace one graph a step shape,
    and each gets the logits of its own unpadded keys."""
    model = load_model(checkpoint.mlx_dir)
    block = DecoderCache.prompt_block
    for length in (2, block // 2, block, block + 1):
        prompt = mx.array([(checkpoint.prompt_ids * block)[: length - 1] + [1]])
        cache = model.make_cache(model.encode(prompt))
        assert cache.cross_keys_values[0][0].shape[2] == (block if length <= block else 2 * block)
        model.decode(mx.array([[0, 5]]), model.make_cache(model.encode(prompt)))  # runs plainly if its shape is new
        padded = model.decode(mx.array([[0, 5]]), cache)
        assert model.traced_shapes == (1 if length <= block else 2)
        encoded = model.encode(prompt)
        own_keys = [layer.cross_attention.project_keys_values(encoded) for layer in model.decoder.layers]
        unpadded = DecoderCache(own_keys, None)
        keys, values = unpadded.reserve(2)
        plain = model.decode_step(mx.array([[0, 5]]), mx.array(unpadded.offsets), keys, values, own_keys, None)[0]
        np.testing.assert_allclose(np.array(padded), np.array(plain), rtol=0, atol=1e-5 * float(mx.abs(plain).max()))


def model_inputs(model, prompt: mx.array, tokens: int = 2) -> tuple:
    """decode_step's arguments after `prompt` is encoded, for `tokens` new tokens."""
    cache = model.make_cache(model.encode(prompt))
    keys, values = cache.reserve(tokens)
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
    import attention
    import model as t5

    monkeypatch.setattr(t5, "row_chunks", lambda L, n: [(a, min(a + 2 * BLOCK, L)) for a in range(0, L, 2 * BLOCK)])
    monkeypatch.setattr(attention, "attention_blocks", lambda rows, heads, keys: [
        (a, min(a + BLOCK, rows), h, h + 1) for a in range(0, rows, BLOCK) for h in range(heads)])
    ours_model = load_model(unit_scale_v1_0.mlx_dir)
    streams = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))[:lanes]
    rng = np.random.default_rng(length)
    ids = rng.integers(3, 1000, size=(2, length))
    ids[:, -1] = 1
    mask = np.ones_like(ids)
    mask[1, max(1, length - 3):] = 0  # the second prompt is shorter, padded on the right
    ours = np.array(ours_model.encode(mx.array(ids), mx.array(mask), lanes=streams))
    with torch.no_grad():
        theirs, exact = (m.get_encoder()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
                         for m in (unit_scale_v1_0.hf_model, in_float64(unit_scale_v1_0.hf_model)))
    for row in range(2):
        valid = mask[row].astype(bool)
        assert_as_near_as_transformers(ours[row][valid], theirs[row][valid], exact[row][valid], f"row {row}'s encoding")


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "silu"])
def test_cpu_path_activations_equal_torchs_to_float32_precision(name):
    """The CPU path's GELUs and SiLU (rational erf, attention.py's exponential: model.py) against PyTorch's in float64,
    over the range activations take: within a float32 rounding or two of the value's scale, in every dtype they are
    given back in, and with the exact function's gradient (training runs through them)."""
    import model

    ours = model._ACTIVATIONS[name]
    exact = {"gelu": lambda t: torch.nn.functional.gelu(t), "gelu_new": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
             "silu": torch.nn.functional.silu}[name]
    x = np.linspace(-20, 20, 400_001).astype(np.float32)
    x64 = torch.from_numpy(x).double()
    error = np.abs(np.array(ours(mx.array(x)), np.float64) - exact(x64).numpy()) / np.maximum(1.0, np.abs(x))
    assert error.max() < 3e-7, (name, x[error.argmax()], error.max())
    for dtype in (mx.float16, mx.bfloat16):
        assert ours(mx.array(x[:10]).astype(dtype)).dtype == dtype
    points = torch.tensor([-3.0, -1.0, -0.1, 0.0, 0.5, 2.0, 6.0], dtype=torch.float64, requires_grad=True)
    exact(points).sum().backward()
    gradient = mx.grad(lambda v: ours(v).sum())(mx.array(points.detach().numpy().astype(np.float32)))
    np.testing.assert_allclose(np.array(gradient), points.grad.numpy(), atol=2e-6)


@pytest.mark.skipif(not cpu.in_use(), reason="the CPU path's norms; the accelerator's are MLX's fused kernels")
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("width", [64, 1024, 4096])
def test_cpu_path_norms_as_near_float64_as_torchs(kind, width):
    """LayerNorm (the BART family, Whisper) and RMSNorm (T5) on the CPU path: as near float64 as PyTorch's float32 ones,
    at a test fixture's width and at real models' (T5-11B's d_model is 1,024). Summed in one running float32 sum, as
    MLX's CPU backend sums an axis, a norm over 1,024 values was 4 to 5 times as far (docs/DECISIONS.md)."""
    import model
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    rng = np.random.default_rng(width)
    x = (rng.standard_normal((2000, width)) * 3 + rng.standard_normal((2000, 1)) * 2).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(width)).astype(np.float32)
    if kind == "layer":
        ours = model.LayerNorm(width, eps=1e-5)
        ours.update({"weight": mx.array(weight), "bias": mx.array(bias)})
        theirs = torch.nn.LayerNorm(width, eps=1e-5)
        theirs.bias.data = torch.from_numpy(bias)
    else:
        ours = model.RMSNorm(width, eps=1e-6)
        ours.update({"weight": mx.array(weight)})
        theirs = T5LayerNorm(width, eps=1e-6)
    theirs.weight.data = torch.from_numpy(weight)
    with torch.no_grad():
        their_output = theirs(torch.from_numpy(x)).numpy()
    x64 = x.astype(np.float64)  # (T5LayerNorm takes its mean square in float32 whatever the input's type)
    centred = x64 - x64.mean(-1, keepdims=True) if kind == "layer" else x64
    exact = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + ours.eps) * weight + (bias if kind == "layer" else 0)
    our_error, their_error = (np.abs(np.asarray(y, np.float64) - exact).max() for y in (ours(mx.array(x)), their_output))
    assert our_error <= 2 * their_error, (our_error, their_error)
    for dtype in (mx.float16, mx.bfloat16):  # a half-precision model's norm keeps its type
        ours.set_dtype(dtype)
        assert ours(mx.array(x[:2]).astype(dtype)).dtype == dtype
