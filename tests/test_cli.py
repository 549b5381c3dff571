"""main.py: greedy ids against transformers, streaming, sampling knobs, bad input."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from checkpoints import PROMPT, reference_greedy

import cpu
import interactive
import main
import model
from decoder import Sampling, logits_to_probs, regular_generate
from model import load_model

import mlx.core as mx
from mlx.utils import tree_flatten


def run_json(capsys, *argv) -> dict:
    assert main.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_greedy_ids_equal_transformers_greedy(checkpoint, capsys):
    result = run_json(capsys, "--model", str(checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "64", "--prompt", PROMPT)
    assert result["tokens"] == reference_greedy(checkpoint.hf_model, checkpoint.prompt_ids, 64)
    assert result["text"] == checkpoint.tokenizer.decode(result["tokens"])
    stats = result["stats"]
    assert stats["generated"] == 64 and stats["draft_calls"] == stats["drafted"] == stats["accepted"] == 0
    assert stats["target_calls"] == 64 and stats["seconds"] > 0 and stats["tokens_per_second"] > 0
    assert stats["tokens_per_target_call"] == 1.0 and stats["acceptance_rate"] == 0.0


def test_greedy_ids_equal_transformers_generate(checkpoint, capsys):
    if checkpoint.hf_model.config.num_decoder_layers > checkpoint.hf_model.config.num_layers:
        pytest.skip("transformers' generate() breaks when the decoder is deeper than the encoder")
    result = run_json(capsys, "--model", str(checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "64", "--prompt", PROMPT)
    with torch.no_grad():
        generated = checkpoint.hf_model.generate(torch.tensor([checkpoint.prompt_ids]), max_new_tokens=64, do_sample=False, num_beams=1)
    reference = [t for t in generated[0, 1:].tolist() if t != checkpoint.hf_model.config.eos_token_id]
    assert result["tokens"] == reference


def test_cli_prints_the_streamed_text_and_json_gives_the_same_text(v1_1_checkpoint, capsys):
    args = ["--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "40"]
    assert main.main(args) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    result = run_json(capsys, *args)
    assert printed == result["text"] == v1_1_checkpoint.tokenizer.decode(result["tokens"])
    assert " " in printed  # SentencePiece word boundaries became spaces


def test_max_tokens_is_respected(v1_1_checkpoint, capsys):
    result = run_json(capsys, "--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "7")
    assert len(result["tokens"]) == 7 == result["stats"]["generated"]


def test_sampling_is_reproducible_with_a_seed_and_varies_without(v1_1_checkpoint, capsys):
    args = ["--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "30", "--temp", "50"]
    first = run_json(capsys, *args, "--seed", "1")["tokens"]
    again = run_json(capsys, *args, "--seed", "1")["tokens"]
    other = run_json(capsys, *args, "--seed", "2")["tokens"]
    assert first == again and first != other


def test_top_k_1_sampling_is_greedy(v1_1_checkpoint):
    model = load_model(v1_1_checkpoint.mlx_dir)
    prompt = v1_1_checkpoint.prompt_ids
    greedy = list(regular_generate(model, prompt, 20, Sampling(temp=0)))
    assert list(regular_generate(model, prompt, 20, Sampling(temp=3.0, top_k=1))) == greedy


def test_logits_to_probs_applies_temperature_top_k_and_top_p():
    logits = mx.log(mx.array([[0.5, 0.25, 0.15, 0.1]]))
    assert mx.allclose(logits_to_probs(logits, Sampling(temp=1.0)), mx.array([[0.5, 0.25, 0.15, 0.1]]))
    top_k = logits_to_probs(logits, Sampling(temp=1.0, top_k=2))
    assert mx.allclose(top_k, mx.array([[2 / 3, 1 / 3, 0, 0]]))
    # top_p=0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it.
    assert mx.allclose(logits_to_probs(logits, Sampling(temp=1.0, top_p=0.7)), top_k)
    assert mx.allclose(logits_to_probs(logits, Sampling(temp=1.0, top_p=0.1)), mx.array([[1.0, 0, 0, 0]]))
    hot = logits_to_probs(logits, Sampling(temp=1e6))
    assert mx.allclose(hot, mx.full((1, 4), 0.25), atol=1e-4)


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


def test_regular_decoding_counts_the_steps_whose_token_was_used(capsys):
    """Stopping at EOS: one step per generated token, plus the one that gave EOS."""
    stats = run_json(capsys, "--demo", "--regular-decode", "--max-tokens", "100")["stats"]
    assert stats["generated"] < 100 and stats["target_calls"] == stats["generated"] + 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "  "], "prompt is empty"),
        (["--max-tokens", "0"], "--max-tokens must be an integer >= 1 (got 0)"),
        (["--temp", "-0.5"], "--temp must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be a number in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be a number in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be an integer >= 0"),
        (["--model", "no-such-model"], "(looked for no-such-model and mlx_models/no-such-model): run `python convert.py --model no-such-model`"),
        (["--model", __file__], "is a file: give a folder written by convert.py"),
        (["--model", ""], "no target named"),  # not the default t5-11b
        (["--seed", "-1"], "--seed must be an integer in [0, 2**64)"),
        (["--compare"], "drop --regular-decode"),
        (["--sweep"], "drop --regular-decode"),
        (["--seed", str(2**64)], "--seed must be an integer in [0, 2**64)"),
    ],
)
def test_bad_input_gives_one_line_error(v1_1_checkpoint, capsys, argv, message):
    base = ["--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode"]
    assert main.main(base + argv) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_models_read_every_weight_before_the_first_timed_generation(v1_1_checkpoint, monkeypatch, capsys):
    """mx.load maps weights lazily; load reads every one (compile_decoding evaluates them), so a
    one-shot run's tokens/s does not include reading them."""
    evaluated = []
    real_eval = model.mx.eval
    monkeypatch.setattr(model.mx, "eval", lambda *trees: (evaluated.extend(tree_flatten(trees)), real_eval(*trees))[1])
    models = model.load(str(v1_1_checkpoint.mlx_dir))
    read = {id(array) for _, array in evaluated}
    assert all(id(weight) in read for _, weight in tree_flatten(models.target.parameters()))
    assert main.main(["--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "2", "--json"]) == 0
    assert "Loading" in capsys.readouterr().err  # said on stderr, as stdout may be --json


@pytest.mark.skipif(sys.platform == "darwin", reason="MLX compiles kernels with a C++ compiler on Linux only")
def test_a_first_run_says_it_waits_for_mlx_to_compile_its_cpu_kernels(v1_1_checkpoint, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cpu.tempfile, "gettempdir", lambda: str(tmp_path))
    model.load(str(v1_1_checkpoint.mlx_dir), verbose=True)
    assert "First run of MLX" in capsys.readouterr().err
    kernels = tmp_path / "mlx" / model.mx.__version__ / "cpu"
    kernels.mkdir(parents=True)
    (kernels / "libkernel.so").touch()
    model.load(str(v1_1_checkpoint.mlx_dir), verbose=True)
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


@pytest.mark.parametrize("plot, message", [("missing/sweep.png", "cannot write there"), (".", "cannot write there"),
                                           ("sweep.txt", "give a .png, .svg or .pdf")])
def test_a_plot_that_cannot_be_saved_is_refused_before_the_sweep(capsys, tmp_path, plot, message):
    argv = ["--demo", "--sweep", "--num-drafts", "1", "--deltas", "0", "--plot", str(tmp_path / plot)]
    assert main.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_shows_every_default_including_zero():
    text = " ".join(main.build_parser().format_help().split())
    assert "sampling temperature; 0 is greedy (default: 0.0)" in text
    assert "sample from the k most likely tokens (0: all) (default: 0)" in text


def test_cli_process_streams_text_then_statistics(v1_1_checkpoint):
    """The real entry point: exit 0, the decoded text, then the statistics line."""
    done = subprocess.run(
        [sys.executable, "main.py", "--model", str(v1_1_checkpoint.mlx_dir), "--regular-decode", "--max-tokens", "12"],
        capture_output=True, text=True, cwd=os.path.dirname(main.__file__),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    tokens = reference_greedy(v1_1_checkpoint.hf_model, v1_1_checkpoint.prompt_ids, 12)
    assert lines[0] == v1_1_checkpoint.tokenizer.decode(tokens)
    assert lines[1].startswith("12 decode steps, 12 tokens in")


def test_fill_spans_puts_each_span_where_its_sentinel_was():
    prompt = "def <extra_id_0>(self): return <extra_id_1>.x"
    assert interactive.fill_spans(prompt, "<extra_id_0> area<extra_id_1> self") == "def «area»(self): return «self».x"
    assert interactive.fill_spans(prompt, "<extra_id_0> area") == "def «area»(self): return «?».x"


def test_a_prompts_file_line_that_is_not_utf8_is_named(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"first prompt\nsecond\n\xff\xfe broken\n")
    assert main.main(["--demo", "--sweep", "--prompts-file", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {prompts}, line 3: not valid UTF-8 text"


def test_starting_up_imports_neither_pytorch_nor_transformers():
    """The tokenizer comes from tokenizer.json through the tokenizers library."""
    code = ("import runpy, sys; sys.argv = ['main.py', '--demo', '--max-tokens', '3']\n"
            "try:\n    runpy.run_path('main.py', run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(main.__file__))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_statistics_give_the_prompts_length_and_a_long_prompt_is_warned_of(capsys, recwarn):
    import decoder

    prompt = " ".join(main.demo_prompts())  # about a thousand tokens
    assert main.main(["--demo", "--regular-decode", "--max-tokens", "3", "--prompt", prompt]) == 0
    tokens = len(model.load_tokenizer(main.DEMO_DIR / "target").encode(prompt))
    assert tokens > decoder.TRAINED_LENGTH
    assert f"prompt {tokens:,} tokens" in capsys.readouterr().out
    assert any(f"the prompt has {tokens:,} tokens, more than the 512 T5 was trained on" in str(w.message) for w in recwarn)


def test_a_prompt_that_will_take_a_while_to_encode_is_announced(capsys, monkeypatch):
    import decoder

    monkeypatch.setattr(decoder, "ASSUMED_ENCODING_RATE", 1e6)  # a very slow machine
    assert main.main(["--demo", "--regular-decode", "--max-tokens", "2"]) == 0
    assert re.search(r"Encoding a \d+-token prompt: about \d+ s \.\.\.", capsys.readouterr().err)


def test_the_encoding_estimate_grows_with_the_square_of_the_length():
    import decoder

    target = load_model(main.DEMO_DIR / "target")
    short, long = decoder.encoding_flops(target, 512), decoder.encoding_flops(target, 8192)
    assert 16 < long / short < 256  # linear products, quadratic attention


def test_a_model_with_more_outputs_than_its_tokenizer_has_is_warned_of(tmp_path, tokenizer_dir, recwarn):
    from checkpoints import make_checkpoint, t5_config

    import convert

    make_checkpoint(tmp_path / "hf", t5_config(vocab_size=32128), 0, tokenizer_dir)  # the tokenizer has 1100 pieces
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    model.load(tmp_path / "mlx")
    assert any("32,128 output tokens but its tokenizer only 1,100" in str(w.message) for w in recwarn)


def test_half_precision_on_the_cpu_is_warned_of(v1_1_checkpoint, tmp_path, recwarn):
    import convert

    convert.convert(str(v1_1_checkpoint.hf_dir), tmp_path / "bf16", "bfloat16", force=False)
    model.load(tmp_path / "bf16")
    slow = [str(w.message) for w in recwarn if "no fast half-precision products" in str(w.message)]
    assert len(slow) == (1 if mx.default_device() == mx.cpu else 0)
