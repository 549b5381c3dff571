"""convert.py -q: mlx-lm's quantized layout, accuracy, exact speculative decoding, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from checkpoints import make_checkpoint, t5_config
from support import decode, regular

import convert
import cpu
import main
from loading import Models, load_model, load_tokenizer
from options import Settings, Stats

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"
Q8, Q4 = convert.Quantization(bits=8), convert.Quantization(bits=4)


def run_convert(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "convert.py", *argv], capture_output=True, text=True, cwd=ROOT)


def logits(folder, prompt=(5, 6, 7, 8, 9, 1), decoder=(0, 9, 10, 11)) -> np.ndarray:
    model = load_model(folder)
    out = model.decode(mx.array([decoder]), model.make_cache(model.encode(mx.array([prompt]))))
    return np.array(out.astype(mx.float32))


@pytest.fixture(scope="module")
def unit_scale_hf(tmp_path_factory, tokenizer_dir) -> Path:
    """A v1.1-style checkpoint (gated FFN, separate head) with weights of order one."""
    folder = tmp_path_factory.mktemp("unit-scale") / "hf"
    make_checkpoint(folder, t5_config(feed_forward_proj="gated-gelu", initializer_factor=1.0), 5, tokenizer_dir, untied_head=True)
    return folder


def test_layout_and_config_follow_mlx_lm(unit_scale_hf, tmp_path):
    """Projections, embedding and head become .weight (uint32), .scales and
    .biases in --dtype; position-bias tables and norms stay float, without .scales."""
    convert.convert(str(unit_scale_hf), tmp_path / "q", "bfloat16", False, Q4)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    weights = mx.load(str(tmp_path / "q" / "model.safetensors"))
    quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
    expected = {"shared", "lm_head", "encoder.layers.0.attention.q", "decoder.layers.1.ffn.wi_0", "decoder.layers.1.ffn.wo"}
    assert expected <= quantized
    for name in quantized:
        d_in = 64 * weights[f"{name}.scales"].shape[1]
        assert weights[f"{name}.weight"].dtype == mx.uint32 and weights[f"{name}.weight"].shape[1] == d_in * 4 // 32
        assert weights[f"{name}.scales"].dtype == weights[f"{name}.biases"].dtype == mx.bfloat16
    floats = [name for name in weights if name.rsplit(".", 1)[0] not in quantized]
    assert floats and all("norm" in name or "relative_attention_bias" in name for name in floats), floats
    assert all(weights[name].dtype == mx.bfloat16 for name in floats)
    model = load_model(tmp_path / "q")
    assert isinstance(model.shared, nn.QuantizedEmbedding) and isinstance(model.lm_head, nn.QuantizedLinear)
    assert type(model.encoder.relative_attention_bias.embeddings) is nn.Embedding


@pytest.mark.parametrize("quantization, tolerance", [(Q8, 0.03), (Q4, 0.35)])
def test_quantized_logits_stay_close_to_float(unit_scale_hf, tmp_path, quantization, tolerance):
    """Max |logit error| as a share of the largest logit: 1.9% measured at
    8 bits, 25% at 4 bits (groups of 64, this random model)."""
    convert.convert(str(unit_scale_hf), tmp_path / "f32", "float32", False)
    convert.convert(str(unit_scale_hf), tmp_path / "q", "float32", False, quantization)
    full, quantized = logits(tmp_path / "f32"), logits(tmp_path / "q")
    error = np.abs(quantized - full).max() / np.abs(full).max()
    assert 0 < error < tolerance, error


def test_quantizing_a_converted_folder_equals_quantizing_the_checkpoint(unit_scale_hf, tmp_path):
    """No second download: a float conversion quantizes to the same tensors."""
    convert.convert(str(unit_scale_hf), tmp_path / "f32", "float32", False)
    convert.convert(str(unit_scale_hf), tmp_path / "direct", "float32", False, Q4)
    convert.convert(str(tmp_path / "f32"), tmp_path / "again", "float32", False, Q4)
    direct, again = (mx.load(str(tmp_path / name / "model.safetensors")) for name in ("direct", "again"))
    assert direct.keys() == again.keys()
    assert all(mx.array_equal(direct[name], again[name]).item() for name in direct)
    first, second = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("direct", "again"))
    assert second["mlx_conversion"]["source"] == first["mlx_conversion"]["source"] == str(unit_scale_hf)


def test_weights_whose_input_is_not_a_multiple_of_the_group_stay_float_and_are_named(tmp_path, tokenizer_dir):
    """d_model 64 with groups of 128: only wo (input d_ff 128) is quantized."""
    make_checkpoint(tmp_path / "hf", t5_config(initializer_factor=1.0), 0, tokenizer_dir)
    done = run_convert("--model", str(tmp_path / "hf"), "--out", str(tmp_path / "q"), "-q", "--q-group-size", "128",
                       "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "stay in float32, their input dimension not a multiple of 128" in done.stderr
    weights = mx.load(str(tmp_path / "q" / "model.safetensors"))
    assert {name for name in weights if name.endswith(".scales")} == {
        f"{stack}.layers.{i}.ffn.wo.scales" for stack in ("encoder", "decoder") for i in range(2)}
    model = load_model(tmp_path / "q")
    assert np.isfinite(np.array(model.decode(mx.array([[0, 5]]), model.make_cache(model.encode(mx.array([[7, 8, 1]])))))).all()


@pytest.fixture(scope="module")
def demo_quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-q")
    for bits in (8, 4):
        convert.convert(str(DEMO / "target"), root / f"{bits}bit", "float32", False, convert.Quantization(bits=bits))
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(p) for p in main.demo_prompts()]
    return {bits: load_model(root / f"{bits}bit") for bits in (8, 4)}, load_model(DEMO / "draft"), prompts


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_draft", [1, 3, 8])
def test_greedy_speculative_with_a_quantized_target_is_that_targets_own_output(demo_quantized, bits, num_draft):
    """The verify pass sends several rows through the quantized products, a
    regular step one; on the CPU each row is computed alike, so no token flips."""
    targets, draft, prompts = demo_quantized
    for prompt in prompts[:4]:
        assert decode(Models(targets[bits], draft), prompt, Settings(num_draft=num_draft)) == regular(targets[bits], prompt)


@pytest.mark.skipif(not cpu.mlx_computes_on_cpu(),
                    reason="a property of MLX's CPU kernels: a GPU multiplies one row and many with different kernels")
def test_quantized_products_give_each_row_the_same_result_alone_or_together():
    x, weight = mx.random.normal((9, 1024)), mx.random.normal((4096, 1024))
    for bits in (8, 4):
        packed, scales, biases = mx.quantize(weight, 64, bits)
        together = mx.quantized_matmul(x, packed, scales, biases, group_size=64, bits=bits)
        alone = mx.concatenate([mx.quantized_matmul(x[i : i + 1], packed, scales, biases, group_size=64, bits=bits)
                                for i in range(9)])
        assert mx.array_equal(together, alone).item()


def test_the_8_bit_demo_target_fills_the_held_out_prompts_as_the_float_one_does(demo_quantized):
    targets, _, prompts = demo_quantized
    full = load_model(DEMO / "target")
    same = sum(regular(targets[8], p) == regular(full, p) for p in prompts)
    assert same >= 18, same


def test_the_float_draft_still_drafts_for_a_quantized_target(demo_quantized):
    targets, draft, prompts = demo_quantized
    for bits in (8, 4):
        stats = Stats()
        for prompt in prompts[:10]:
            decode(Models(targets[bits], draft), prompt, Settings(num_draft=3), stats)
        assert 0.5 < stats.acceptance_rate < 0.95, (bits, stats)


def damaged_copy(source: Path, out: Path, damage: str) -> Path:
    out.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    weights = dict(mx.load(str(source / "model.safetensors")))
    if damage == "missing scales":
        del weights["decoder.layers.0.ffn.wi.scales"]
        mx.save_safetensors(str(out / "model.safetensors"), weights)
    else:  # truncated scales: cut the file inside its last tensor
        data = (source / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(data[: len(data) - 100])
    return out


@pytest.mark.parametrize("damage", ["missing scales", "truncated"])
def test_a_damaged_quantized_folder_gives_a_one_line_error(demo_quantized, tmp_path, damage, capsys):
    convert.convert(str(DEMO / "target"), tmp_path / "q", "float32", False, Q4)
    folder = damaged_copy(tmp_path / "q", tmp_path / "damaged", damage)
    capsys.readouterr()
    assert main.main(["--model", str(folder), "--regular-decode", "--max-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "convert the model again" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["-q", "--q-bits", "7"], "--q-bits must be one of 2, 3, 4, 5, 6, 8 (got 7)"),
    (["-q", "--q-group-size", "48"], "--q-group-size must be one of 32, 64, 128 (got 48)"),
    (["--q-bits", "8"], "--q-bits and --q-group-size go with -q/--quantize"),
])
def test_bad_quantization_options_give_one_line_errors_and_write_nothing(tmp_path, argv, message):
    done = run_convert("--model", str(DEMO / "draft"), "--out", str(tmp_path / "out"), *argv)
    assert done.returncode != 0 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_quantizing_a_quantized_folder_is_refused(tmp_path):
    convert.convert(str(DEMO / "draft"), tmp_path / "q", "float32", False, Q4)
    done = run_convert("--model", str(tmp_path / "q"), "--out", str(tmp_path / "again"), "-q", "--q-bits", "8")
    assert done.returncode != 0 and "is already quantized (4-bit)" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "again").exists()


def test_the_default_output_of_a_quantization_says_its_bits(tmp_path, monkeypatch):
    assert convert.default_out("t5-11b", Q4) == Path("mlx_models/t5-11b-4bit")
    assert convert.default_out("google/flan-t5-xl", convert.Quantization(bits=8)) == Path("mlx_models/flan-t5-xl-8bit")


def test_converting_into_the_source_folder_is_refused_and_leaves_it_whole(tmp_path):
    convert.convert(str(DEMO / "draft"), tmp_path / "f32", "float32", False)
    before = {file.name: file.read_bytes() for file in (tmp_path / "f32").iterdir()}
    done = run_convert("--model", str(tmp_path / "f32"), "--out", str(tmp_path / "f32"), "-q", "--force")
    assert done.returncode != 0 and "is the folder being converted" in done.stderr
    assert {file.name: file.read_bytes() for file in (tmp_path / "f32").iterdir()} == before


def test_a_quantized_target_and_a_float_draft_of_other_bits_run_as_a_pair(tmp_path, capsys):
    convert.convert(str(DEMO / "target"), tmp_path / "target", "float32", False, Q4)
    convert.convert(str(DEMO / "draft"), tmp_path / "draft", "float32", False, convert.Quantization(bits=8))
    prompt = main.demo_prompts()[0]
    assert main.main(["--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"), "--delta", "0",
                      "--prompt", prompt, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    alone = regular(load_model(tmp_path / "target"), load_tokenizer(DEMO / "target").encode(prompt))
    assert result["tokens"] == alone and result["stats"]["drafted"] > 0


def test_held_out_loss_evaluation_reproduces_training_and_reads_quantized_models(demo_quantized, tmp_path):
    """demo/train.py --evaluate: the float target's loss is the one training
    recorded; a quantized model is scored through its dequantized weights,
    which compute what its quantized products do."""
    import train

    recorded = json.loads((DEMO / "training.json").read_text())["target"]["heldout_loss"]
    assert train.evaluate([DEMO / "target"])[str(DEMO / "target")] == pytest.approx(recorded, abs=1e-4)
    convert.convert(str(DEMO / "target"), tmp_path / "q", "float32", False, Q4)
    quantized = load_model(tmp_path / "q")
    tokens, prompt = mx.array([[0, 9, 10, 11]]), mx.array([[7, 8, 9, 1]])
    expected = quantized.decode(tokens, quantized.make_cache(quantized.encode(prompt)))
    float_model = train.dequantized(load_model(tmp_path / "q"))
    assert type(float_model.shared) is nn.Embedding
    got = float_model.decode(tokens, float_model.make_cache(float_model.encode(prompt)))
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4 * np.abs(np.array(expected)).max())
