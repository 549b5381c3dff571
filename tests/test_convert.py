"""convert.py: checkpoint formats, bounded memory, atomic output, one-line errors."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import PROMPT, family_checkpoint, make_checkpoint, t5_config
from support import assert_as_near_as_transformers, in_float64

import convert
import main
import mlx.core as mx
import weights
from loading import load_model

ROOT = Path(__file__).resolve().parent.parent


def run_convert(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "convert.py", *argv], capture_output=True, text=True, cwd=ROOT, env=env)


def logits(folder, prompt=(5, 6, 7, 1), decoder=(0, 9, 10)):
    model = load_model(folder)
    out = model.decode(mx.array([decoder]), model.make_cache(model.encode(mx.array([prompt]))))
    return np.array(out.astype(mx.float32))


def assert_converted(folder, hf) -> None:
    """The conversion's logits as near transformers' float64 ones as its own float32 come."""
    with torch.no_grad():
        theirs, exact = (model(input_ids=torch.tensor([[5, 6, 7, 1]]), decoder_input_ids=torch.tensor([[0, 9, 10]])).logits
                         for model in (hf, in_float64(hf)))
    assert_as_near_as_transformers(logits(folder), theirs, exact)


@pytest.mark.parametrize(
    "layout",
    [
        dict(format="safetensors", max_shard_size=7),
        dict(format="bin"),
        dict(format="bin", max_shard_size=7),
        dict(format="legacy-bin"),
        dict(format="safetensors", untied_head=True),
    ],
    ids=["sharded-safetensors", "pytorch-bin", "sharded-pytorch-bin", "legacy-pytorch-bin", "untied-head"],
)
def test_every_checkpoint_layout_converts_to_the_same_model(layout, tmp_path, tokenizer_dir):
    config = t5_config(initializer_factor=1.0)
    hf = make_checkpoint(tmp_path / "hf", config, 0, tokenizer_dir, **layout)
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    assert_converted(tmp_path / "mlx", hf)


def test_duplicated_embedding_and_head_entries_are_accepted(tmp_path, tokenizer_dir):
    """Old checkpoints store encoder/decoder.embed_tokens and lm_head copies of shared."""
    from safetensors.torch import load_file, save_file

    hf = make_checkpoint(tmp_path / "hf", t5_config(initializer_factor=1.0), 0, tokenizer_dir)
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(str(file))
    shared = state.pop("shared.weight")
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        state[name] = shared.clone()
    save_file(state, str(file))
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    written = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    assert "lm_head.weight" not in written  # tied: one copy
    assert_converted(tmp_path / "mlx", hf)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_output_is_close_to_float32(dtype, tmp_path, tokenizer_dir):
    config = t5_config(feed_forward_proj="gated-gelu", initializer_factor=1.0)
    make_checkpoint(tmp_path / "hf", config, 0, tokenizer_dir, untied_head=True)
    for name in ("float32", dtype):
        convert.convert(str(tmp_path / "hf"), tmp_path / name, name, force=False)
    written = json.loads((tmp_path / dtype / "config.json").read_text())
    assert written["mlx_conversion"]["dtype"] == dtype
    assert load_model(tmp_path / dtype).shared.weight.dtype == getattr(mx, dtype)
    full, half = logits(tmp_path / "float32"), logits(tmp_path / dtype)
    assert np.abs(half - full).max() < 0.02 * np.abs(full).max()


def test_converted_folder_loads_without_the_source(v1_1_checkpoint, tmp_path):
    out = tmp_path / "standalone"
    convert.convert(str(v1_1_checkpoint.hf_dir), out, "float32", force=False)
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "model.safetensors" in names and "tokenizer.json" in names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folders left
    np.testing.assert_array_equal(logits(out), logits(v1_1_checkpoint.mlx_dir))


def test_failed_conversion_leaves_no_output_folder(v1_1_checkpoint, tmp_path, monkeypatch):
    def fail_midway(path, *args):
        path.write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(convert, "write_shard", fail_midway)
    with pytest.raises(convert.ConversionError, match="conversion failed: disk full"):
        convert.convert(str(v1_1_checkpoint.hf_dir), tmp_path / "out", "float32", force=False)
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_an_earlier_conversion(v1_1_checkpoint, tmp_path):
    out = tmp_path / "out"
    convert.convert(str(v1_1_checkpoint.hf_dir), out, "float32", force=False)
    (out / "stale").write_text("old")
    done = run_convert("--model", str(v1_1_checkpoint.hf_dir), "--out", str(out), "--dtype", "float32")
    assert done.returncode != 0 and "--force" in done.stderr
    done = run_convert("--model", str(v1_1_checkpoint.hf_dir), "--out", str(out), "--dtype", "float32", "--force")
    assert done.returncode == 0, done.stderr
    assert not (out / "stale").exists() and (out / "config.json").exists()
    # The command it suggests runs the new model as it is, without a draft model.
    suggested = done.stdout.split("Try it: python main.py ")[1].split(" (")[0].split()
    assert main.main([*suggested, "--max-tokens", "3"]) == 0


@pytest.mark.parametrize("existing", ["documents", "a file", "a link to a conversion"])
def test_force_never_deletes_what_is_not_a_converted_model(v1_1_checkpoint, tmp_path, existing):
    out = tmp_path / "out"
    if existing == "documents":
        out.mkdir()
        (out / "precious.txt").write_text("keep me")
    elif existing == "a file":
        out.write_text("keep me")
    else:
        out.symlink_to(v1_1_checkpoint.mlx_dir)
    done = run_convert("--model", str(v1_1_checkpoint.hf_dir), "--out", str(out), "--force")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert ("is a file: choose another --out" if existing == "a file" else "--force") in done.stderr
    if existing == "documents":
        assert (out / "precious.txt").read_text() == "keep me"
    elif existing == "a file":
        assert out.read_text() == "keep me"
    else:
        assert out.is_symlink() and (v1_1_checkpoint.mlx_dir / "config.json").exists()


@pytest.mark.parametrize("earlier", ["empty", "damaged config"])
def test_force_replaces_an_empty_folder_or_a_conversion_with_a_damaged_config(v1_1_checkpoint, tmp_path, earlier):
    out = tmp_path / "out"
    if earlier == "empty":
        out.mkdir()
    else:
        convert.convert(str(v1_1_checkpoint.hf_dir), out, "float32", force=False)
        (out / "config.json").write_text('{"mlx_conv')
    convert.convert(str(v1_1_checkpoint.hf_dir), out, "float32", force=True)
    np.testing.assert_array_equal(logits(out), logits(v1_1_checkpoint.mlx_dir))


def test_an_output_that_appears_during_the_conversion_is_not_replaced(v1_1_checkpoint, tmp_path, monkeypatch):
    out, write_shard = tmp_path / "out", convert.write_shard

    def someone_creates_the_output(*args):
        write_shard(*args)
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("keep me")

    monkeypatch.setattr(convert, "write_shard", someone_creates_the_output)
    with pytest.raises(convert.ConversionError, match="already exists"):
        convert.convert(str(v1_1_checkpoint.hf_dir), out, "float32", force=False)
    assert (out / "notes.txt").read_text() == "keep me"


def test_the_default_output_is_named_after_the_source_folder_or_hub_repo(tmp_path, monkeypatch):
    (tmp_path / "flan-t5-small").mkdir()
    monkeypatch.chdir(tmp_path / "flan-t5-small")
    assert convert.default_out(".") == Path("mlx_models/flan-t5-small")  # never mlx_models itself
    assert convert.default_out("google/flan-t5-large") == Path("mlx_models/flan-t5-large")
    assert convert.default_out(str(tmp_path / "flan-t5-small") + "/") == Path("mlx_models/flan-t5-small")


def test_only_work_folders_of_killed_conversions_are_removed(v1_1_checkpoint, tmp_path):
    def work_folder(name: str, pid: int, owner: bool = True):
        folder = tmp_path / name
        folder.mkdir()
        if owner:
            (folder / weights.OWNER).write_text(f"{socket.gethostname()} {pid}")
        return folder

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # that process has exited
    killed = [work_folder(f".out.partial-{dead_pid}", dead_pid),
              work_folder(f".another-model.partial-{dead_pid}", dead_pid)]  # any output's, not only this one's
    kept = [
        work_folder(f".out.partial-{os.getppid()}", os.getppid()),  # a live conversion
        work_folder(f".out.old-{dead_pid}", dead_pid),  # not a work folder
        work_folder(f".out.partial-{dead_pid + 1}", dead_pid, owner=False),  # no owner: not ours to judge
    ]
    convert.convert(str(v1_1_checkpoint.hf_dir), tmp_path / "out", "float32", force=False)
    assert not any(folder.exists() for folder in killed) and all(folder.exists() for folder in kept)
    assert not (tmp_path / "out" / weights.OWNER).exists()


def conversion_growth(source: Path, out: Path, quantize: bool, torch_too: bool = False) -> int:
    """How much convert.py's peak resident memory grows converting source, in a process of its own."""
    # VmHWM: the peak resident memory of this process image (ru_maxrss would
    # inherit the test runner's peak across fork).
    script = (
        "import re, sys; peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]);"
        f"import convert; {'import torch;' if torch_too else ''} before = peak();"
        "code = convert.main(sys.argv[1:]); print(before, peak()); sys.exit(code)"
    )
    argv = ["--model", str(source), "--out", str(out), "--dtype", "float32"] + ["-q"] * quantize
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    before_kb, after_kb = map(int, done.stdout.splitlines()[-1].split())
    return (after_kb - before_kb) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("format, quantize", [("safetensors", False), ("bin", False), ("safetensors", True)])
def test_conversion_memory_is_bounded_by_a_tensor_not_the_model(tmp_path, tokenizer_dir, format, quantize):
    """Converting a ~400 MB checkpoint grows memory by a few tensors, not by the file (quantizing too)."""
    config = t5_config(vocab_size=32128, d_model=512, d_ff=2048, num_heads=8, d_kv=64, num_layers=12, initializer_factor=1.0)
    largest_tensor = 32128 * 512 * 4
    make_checkpoint(tmp_path / "hf", config, 0, tokenizer_dir, format=format)
    size = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*model.*"))
    growth = conversion_growth(tmp_path / "hf", tmp_path / "mlx", quantize, torch_too=format == "bin")
    assert growth < 3 * largest_tensor + 50e6 < size, f"peak memory grew {growth / 1e6:.0f} MB converting {size / 1e6:.0f} MB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("kind, quantize", [("bart", False), ("m2m_100", True), ("umt5", False)])
def test_each_familys_conversion_memory_is_bounded_by_a_tensor_not_the_model(kind, quantize, tmp_path, tokenizer_dir):
    """The renames, the folded query scaling and the sinusoidal tables stream as T5's weights do."""
    family_checkpoint(kind, tmp_path / "hf", tokenizer_dir, layers=12, vocab_size=32128, d_model=512, heads=8)
    largest_tensor = 32128 * 512 * 4
    size = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*model.*"))
    growth = conversion_growth(tmp_path / "hf", tmp_path / "mlx", quantize)
    assert growth < 3 * largest_tensor + 50e6 < size, f"peak memory grew {growth / 1e6:.0f} MB converting {size / 1e6:.0f} MB"
    assert load_model(tmp_path / "mlx").args.vocab_size == 32128


def make_bert_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    return path


def make_truncated_checkpoint(path: Path, tokenizer_dir) -> Path:
    make_checkpoint(path, t5_config(), 0, tokenizer_dir)
    weights = path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return path


def make_untied_config_without_head(path: Path, tokenizer_dir) -> Path:
    make_checkpoint(path, t5_config(), 0, tokenizer_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("not/a/valid id!", "there is no folder not/a/valid id! here (and it is not a Hugging Face hub id"),
        ("mlx_models/t5-11b", "there is no folder mlx_models/t5-11b here"),  # never tried as a download
        ("empty folder", "holds no Hugging Face checkpoint (no config.json)"),
        ("bert folder", "a 'bert' model is not one this converts (it takes: t5, mt5, umt5, bart"),
        ("truncated", "truncated or corrupt"),
        ("hub id offline", "hub is unreachable"),
        ("already quantized", "is already quantized"),
        ("untied config, no head", "has no lm_head.weight"),
    ],
)
def test_bad_sources_give_one_line_errors(case, message, tmp_path, tokenizer_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    model = {
        "not/a/valid id!": lambda: "not/a/valid id!",
        "mlx_models/t5-11b": lambda: "mlx_models/t5-11b",
        "empty folder": lambda: str((tmp_path / "empty").mkdir() or tmp_path / "empty"),
        "bert folder": lambda: str(make_bert_folder(tmp_path / "bert")),
        "truncated": lambda: str(make_truncated_checkpoint(tmp_path / "trunc", tokenizer_dir)),
        "hub id offline": lambda: "google/flan-t5-small",
        "already quantized": lambda: str(convert.convert(str(ROOT / "demo" / "draft"), tmp_path / "q", "float32", False,
                                                         convert.Quantization())),
        "untied config, no head": lambda: str(make_untied_config_without_head(tmp_path / "nohead", tokenizer_dir)),
    }[case]()
    done = run_convert("--model", model, "--out", str(tmp_path / "out"), env=env)
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_file_in_the_way_is_named_without_suggesting_force(v1_1_checkpoint, tmp_path):
    (tmp_path / "out").write_text("keep me")
    done = run_convert("--model", str(v1_1_checkpoint.hf_dir), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "is a file: choose another --out" in done.stderr and "--force" not in done.stderr


@pytest.mark.parametrize("where", ["a file as its folder", "a read-only file system"])
def test_an_output_that_cannot_be_written_gives_one_line_naming_it(v1_1_checkpoint, tmp_path, monkeypatch, where, capsys):
    """Not a traceback naming the hidden work folder: the output the user asked for."""
    if where == "a file as its folder":
        (tmp_path / "models").write_text("")
        out = tmp_path / "models" / "tiny"  # a real OSError: its parent is a file
    else:
        out = tmp_path / "tiny"
        real_mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if self.name.startswith(".tiny.partial-"):
                raise OSError(30, "Read-only file system", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only)
    assert convert.main(["--model", str(v1_1_checkpoint.hf_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: cannot write {out}: ") and "partial" not in err, err
    assert [p.name for p in tmp_path.iterdir()] == (["models"] if where == "a file as its folder" else [])


def test_an_unreadable_source_file_gives_one_line_naming_it(v1_1_checkpoint, tmp_path, monkeypatch, capsys):
    """As for a model.safetensors of mode 000 (tests may run as root, whom modes do not stop)."""
    source_file = v1_1_checkpoint.hf_dir / "model.safetensors"
    real_open = open

    def unreadable(file, *args, **kwargs):
        if Path(file) == source_file:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(weights, "open", unreadable, raising=False)  # where the checkpoint's files are read
    assert convert.main(["--model", str(v1_1_checkpoint.hf_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: cannot read {source_file}: Permission denied" and not (tmp_path / "out").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_during_a_conversion_leaves_nothing_behind(tmp_path, tokenizer_dir):
    """As Ctrl-C does: the hidden work folder goes, the exit code says why."""
    import signal
    import time

    config = t5_config(vocab_size=32128, d_model=512, d_ff=2048, num_heads=8, d_kv=64, num_layers=8, initializer_factor=1.0)
    make_checkpoint(tmp_path / "hf", config, 0, tokenizer_dir)
    process = subprocess.Popen([sys.executable, "convert.py", "--model", str(tmp_path / "hf"),
                                "--out", str(tmp_path / "models" / "out")],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list((tmp_path / "models").glob(".out.partial-*/model.safetensors")) and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143 and "terminated: nothing was written" in err, err
    assert list((tmp_path / "models").iterdir()) == []


def test_the_default_dtype_is_bfloat16_on_a_mac_and_float32_elsewhere(v1_1_checkpoint, tmp_path):
    """MLX's CPU backend has no fast half-precision products."""
    done = run_convert("--model", str(v1_1_checkpoint.hf_dir), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    dtype = json.loads((tmp_path / "out" / "config.json").read_text())["mlx_conversion"]["dtype"]
    assert dtype == ("bfloat16" if sys.platform == "darwin" else "float32")


def test_a_checkpoint_with_only_spiece_model_gets_a_tokenizer_json(tmp_path, tokenizer_dir):
    """main.py reads tokenizer.json without transformers; conversion writes one when the source has none."""
    make_checkpoint(tmp_path / "hf", t5_config(), 0, tokenizer_dir)
    (tmp_path / "hf" / "tokenizer.json").unlink()
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    from transformers import AutoTokenizer

    from loading import Tokenizer

    ours, theirs = Tokenizer(tmp_path / "mlx" / "tokenizer.json"), AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert ours.encode(PROMPT) == theirs(PROMPT).input_ids
