"""loading.py: converted folders found by name, checked, and read; what it warns of and refuses."""

import json
import os
import sys
from pathlib import Path

import pytest
from mlx.utils import tree_flatten

import cpu
import kernels
import loading
import main
from errors import LoadError, ModelNotFound, T5Error
from loading import load

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"


def run_json(capsys, *argv) -> dict:
    assert main.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_model_name_resolves_under_mlx_models(v1_1_checkpoint, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlx_models").mkdir()
    os.symlink(v1_1_checkpoint.mlx_dir, tmp_path / "mlx_models" / "tiny")
    assert len(run_json(capsys, "--model", "tiny", "--regular-decode", "--max-tokens", "3")["tokens"]) == 3


def test_a_hub_id_finds_the_model_converted_from_it_and_no_other(v1_1_checkpoint, capsys, tmp_path, monkeypatch):
    """convert.py --model some-org/tiny writes mlx_models/tiny, recording its source."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "mlx_models" / "tiny"
    folder.mkdir(parents=True)
    for file in v1_1_checkpoint.mlx_dir.iterdir():
        if file.name != "config.json":
            os.symlink(file, folder / file.name)
    config = json.loads((v1_1_checkpoint.mlx_dir / "config.json").read_text())
    config["mlx_conversion"]["source"] = "some-org/tiny"
    (folder / "config.json").write_text(json.dumps(config))
    assert len(run_json(capsys, "--model", "some-org/tiny", "--regular-decode", "--max-tokens", "3")["tokens"]) == 3
    assert main.main(["--model", "other-org/tiny", "--regular-decode"]) == 2
    assert "python convert.py --model other-org/tiny" in capsys.readouterr().err


def test_models_read_every_weight_before_the_first_timed_generation(v1_1_checkpoint, monkeypatch, capsys):
    """mx.load maps weights lazily; load reads every one (compile_decoding evaluates them), so a
    one-shot run's tokens/s does not include reading them."""
    evaluated = []
    real_eval = loading.mx.eval
    monkeypatch.setattr(loading.mx, "eval", lambda *trees: (evaluated.extend(tree_flatten(trees)), real_eval(*trees))[1])
    models = loading.load(str(v1_1_checkpoint.mlx_dir))
    read = {id(array) for _, array in evaluated}
    assert all(id(weight) in read for _, weight in tree_flatten(models.target.parameters()))
    assert main.main(["--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "2", "--json"]) == 0
    assert "Loading" in capsys.readouterr().err  # said on stderr, as stdout may be --json


@pytest.mark.skipif(sys.platform == "darwin" or not cpu.mlx_computes_on_cpu(),
                    reason="MLX compiles CPU kernels with a C++ compiler on Linux only, when it computes on the CPU")
def test_a_first_run_says_it_waits_for_mlx_to_compile_its_cpu_kernels(v1_1_checkpoint, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(kernels.tempfile, "gettempdir", lambda: str(tmp_path))
    loading.load(str(v1_1_checkpoint.mlx_dir), verbose=True)
    assert "First run of MLX" in capsys.readouterr().err
    folder = tmp_path / "mlx" / loading.mx.__version__ / "cpu"
    folder.mkdir(parents=True)
    (folder / "libkernel.so").touch()
    loading.load(str(v1_1_checkpoint.mlx_dir), verbose=True)
    assert "First run" not in capsys.readouterr().err


def test_unconverted_folder_is_refused_with_the_convert_command(v1_1_checkpoint, capsys):
    assert main.main(["--model", str(v1_1_checkpoint.hf_dir), "--regular-decode"]) != 0
    err = capsys.readouterr().err
    assert "not a converted MLX model" in err and "convert.py" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["config.json", "model.safetensors", "tokenizer files"])
def test_a_damaged_converted_folder_gives_a_one_line_error(v1_1_checkpoint, capsys, tmp_path, damage):
    folder = tmp_path / "model"
    folder.mkdir()
    for file in v1_1_checkpoint.mlx_dir.iterdir():
        os.symlink(file, folder / file.name)
    if damage == "config.json":
        (folder / "config.json").unlink()
        (folder / "config.json").write_text('{"mlx_conversion": ')
    elif damage == "model.safetensors":
        (folder / "model.safetensors").unlink()
    else:
        for name in ("tokenizer.json", "spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
    assert main.main(["--model", str(folder), "--regular-decode", "--max-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "convert the model again" in err and len(err.strip().splitlines()) == 1, err


def test_a_model_with_more_outputs_than_its_tokenizer_has_is_warned_of(tmp_path, tokenizer_dir, recwarn):
    from checkpoints import make_checkpoint, t5_config

    import convert

    make_checkpoint(tmp_path / "hf", t5_config(vocab_size=32128), 0, tokenizer_dir)  # the tokenizer has 1100 pieces
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    loading.load(tmp_path / "mlx")
    assert any("32,128 output tokens but its tokenizer only 1,100" in str(w.message) for w in recwarn)


def test_half_precision_on_the_cpu_is_warned_of(v1_1_checkpoint, tmp_path, recwarn):
    import convert

    convert.convert(str(v1_1_checkpoint.hf_dir), tmp_path / "bf16", "bfloat16", force=False)
    loading.load(tmp_path / "bf16")
    slow = [str(w.message) for w in recwarn if "no fast half-precision products" in str(w.message)]
    assert len(slow) == (1 if cpu.in_use() else 0)


def test_a_hub_id_finds_its_conversion_even_beside_a_local_folder_of_that_name(tmp_path, monkeypatch):
    """convert.py --model org/name writes mlx_models/name and records the id;
    a stray unconverted ./org/name folder does not hide it."""
    monkeypatch.chdir(tmp_path)
    for name in ("tiny", "other"):
        (tmp_path / "some-org" / name).mkdir(parents=True)
    folder = tmp_path / "mlx_models" / "tiny"
    folder.mkdir(parents=True)
    for file in (DEMO / "target").iterdir():
        if file.name != "config.json":
            os.symlink(file, folder / file.name)
    config = json.loads((DEMO / "target" / "config.json").read_text())
    config["mlx_conversion"]["source"] = "some-org/tiny"
    (folder / "config.json").write_text(json.dumps(config))
    assert load("some-org/tiny").target_path == folder.resolve()
    with pytest.raises(LoadError, match="has no config.json"):
        load("some-org/other")  # no conversion of that id: the local folder's problem is the one to report


def test_load_resolves_names_from_elsewhere_through_the_repository(tmp_path, monkeypatch):
    """A relative name not found from the current folder is looked up from the repository's."""
    monkeypatch.chdir(tmp_path)
    models = load("demo/target", draft="demo/draft")
    assert models.target_path.resolve() == DEMO / "target" and models.draft is not None


@pytest.mark.parametrize("call, error, message", [
    (lambda: load("no-such-model"), ModelNotFound, "no converted target 'no-such-model'"),
    (lambda: load(DEMO / "target", draft="no-such-draft"), ModelNotFound, "no converted draft 'no-such-draft'"),
    (lambda: load(DEMO), LoadError, "has no config.json"),
    (lambda: load(DEMO / "target", draft=""), ModelNotFound, "no draft named"),
])
def test_load_errors_are_the_librarys_own_and_name_no_cli_flags(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert message in str(raised.value) and "--" not in str(raised.value).replace("python convert.py --model", "")
    assert isinstance(raised.value, T5Error)



@pytest.mark.parametrize("call, message", [
    (lambda: load(123), "the target must be a folder or a name (got int)"),
    (lambda: load(DEMO / "target", draft=["demo/draft"]), "the draft must be a folder or a name (got list)"),
])
def test_a_model_that_is_neither_a_path_nor_a_name_is_a_type_error(call, message):
    """load(123) once looked for a folder named "123"."""
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


@pytest.mark.parametrize("name", ["./missing-model", "/nowhere/t5", "~/no-such-folder/t5", "models/../x", "mlx_models/t5-11b"])
def test_a_missing_local_folder_is_not_told_to_download_itself(name, tmp_path, monkeypatch):
    """convert.py cannot download a path: the advice is to convert a checkpoint into it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound) as raised:
        load(name)
    message = str(raised.value)
    assert f"--model {name}" not in message and f"--out {name}" in message, message


def test_a_hub_id_that_was_never_converted_is_told_the_convert_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match="run `python convert.py --model google/flan-t5-small` first"):
        load("google/flan-t5-small")
