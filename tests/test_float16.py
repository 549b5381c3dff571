"""float16 on T5-large's widths: the residual stream overflows without clamping."""

import numpy as np
from checkpoints import make_checkpoint, t5_config
from safetensors.torch import load_file, save_file

import convert
import mlx.core as mx
import model as t5
from loading import load_model

# T5-large's widths (d_model 1024, d_ff 4096, 16 heads of 64) in 4 + 4 layers
# (its 24 + 24 took a minute to build); a small vocabulary keeps the file and
# the test fast.
LARGE = dict(d_model=1024, d_ff=4096, num_heads=16, d_kv=64, num_layers=4, initializer_factor=1.0)


def test_float16_t5_large_widths_give_finite_logits(tmp_path, tokenizer_dir, monkeypatch):
    make_checkpoint(tmp_path / "hf", t5_config(**LARGE), 0, tokenizer_dir)
    # Real v1.0 checkpoints have FFN outputs beyond float16's range (65504);
    # random weights do not, so blow up a few layers the same way.
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(str(file))
    for stack, ffn in (("encoder", 1), ("decoder", 2)):
        for block in (1, 3):
            state[f"{stack}.block.{block}.layer.{ffn}.DenseReluDense.wo.weight"] *= 3e4
    save_file(state, str(file), metadata={"format": "pt"})
    del state
    convert.convert(str(tmp_path / "hf"), tmp_path / "fp16", "float16", force=False)
    model = load_model(tmp_path / "fp16")

    def logits():
        cache = model.make_cache(model.encode(mx.array([[37, 5, 98, 12, 400, 1]])))
        return np.array(model.decode(mx.array([[0, 17, 3]]), cache).astype(mx.float32))

    assert np.isfinite(logits()).all()  # run plainly: a shape's first step
    assert np.isfinite(logits()).all()  # compiled: its second
    monkeypatch.setattr(t5, "clamp_float16", lambda x: x)
    model.compile_decoding()  # the decode step traced so far kept the clamp
    assert not np.isfinite(logits()).all(), "the fixture must overflow float16 without the clamp"
