"""main.py: what it prints, its statistics, one-line errors for bad input, and Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from checkpoints import reference_greedy

import display
import interactive
import main


def run_json(capsys, *argv) -> dict:
    assert main.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


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


def test_regular_decoding_counts_the_steps_whose_token_was_used(capsys):
    """Stopping at EOS: one step per generated token, plus the one that gave EOS."""
    stats = run_json(capsys, "--demo", "--regular-decode", "--max-tokens", "100")["stats"]
    assert stats["generated"] < 100 and stats["target_calls"] == stats["generated"] + 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "  "], "prompt is empty"),
        (["--max-tokens", "0"], "--max-tokens must be an integer in [1, 2**31) (got 0)"),
        (["--temp", "-0.5"], "--temp must be a number in [0, 100]"),
        (["--top-p", "0"], "--top-p must be a number in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be a number in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be an integer in [0, 2**31)"),
        (["--model", "no-such-model"],
         "(looked for no-such-model and mlx_models/no-such-model): run `python convert.py --model no-such-model`"),
        (["--model", "t5-11b-4bit"], "run `python convert.py --model t5-11b -q` first"),  # what convert.py names t5-11b at 4 bits
        (["--model", "mlx_models/t5-11b-8bit"], "run `python convert.py --model t5-11b -q --q-bits 8` first"),
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


def test_stop_strings_end_the_one_shot_and_json_text_before_them(capsys):
    """--stop, once or more: the API's stop strings, through the same text stream."""
    assert main.main(["--demo", "--json", "--max-tokens", "30"]) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert main.main(["--demo", "--json", "--max-tokens", "30", "--stop", "zzz", "--stop", stop]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == full[: full.index(stop)]
    assert main.main(["--demo", "--stop", ""]) == 2 and "--stop takes a non-empty string" in capsys.readouterr().err


@pytest.mark.parametrize("plot, message", [("missing/sweep.png", "cannot write there"), (".", "cannot write there"),
                                           ("sweep.txt", "give a .png, .svg or .pdf")])
def test_a_plot_that_cannot_be_saved_is_refused_before_the_sweep(capsys, tmp_path, plot, message):
    argv = ["--demo", "--sweep", "--num-drafts", "1", "--deltas", "0", "--plot", str(tmp_path / plot)]
    assert main.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_shows_every_default_including_zero():
    text = " ".join(main.build_parser().format_help().split())
    assert "sampling temperature; 0 (or below 1e-05) is greedy (default: 0.0)" in text
    assert "sample from the k most likely tokens (0: all) (default: 0)" in text


@pytest.mark.parametrize("command", [["main.py"], ["server.py"], ["convert.py"], ["-m", "bench"], ["demo/train.py"],
                                     ["demo/train_speech.py"]])
def test_every_entry_point_prints_its_help(command):
    """`--help` of each program a user runs: its usage and options, exit 0 (a help text argparse cannot format, a
    bare % in it, crashed server.py --help)."""
    done = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True,
                          cwd=os.path.dirname(main.__file__), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and "--help" in done.stdout and not done.stderr


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
    assert display.fill_spans(prompt, "<extra_id_0> area<extra_id_1> self") == "def «area»(self): return «self».x"
    assert display.fill_spans(prompt, "<extra_id_0> area") == "def «area»(self): return «?».x"


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




def test_ctrl_c_stops_a_one_shot_run_with_its_statistics_so_far(v1_1_checkpoint):
    """Ctrl-C mid-generation ends the line, prints the statistics so far, and exits 130. (The child takes Python's
    own SIGINT handler: started in the background, as some CI runners start the tests, a shell has it ignore SIGINT,
    and Python keeps an ignored SIGINT ignored.)"""
    code = ("import signal, sys, time, rows, main\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "real = rows.Row.emit\n"
            "def slow(*args):\n"
            "    time.sleep(0.05)\n"
            "    return (yield from real(*args))\n"
            "rows.Row.emit = slow\n"
            f"sys.exit(main.main(['--model', {str(v1_1_checkpoint.mlx_dir)!r}, '--regular-decode', '--max-tokens', '500']))")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(main.__file__),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = process.stdout.read(1)  # the first piece of text: generation has started
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    text, stats = (first + out).splitlines()[-2:]
    assert text and re.match(r"(\d+) decode steps?, \1 tokens? in", stats)
    assert stats.endswith("[stopped]") and err.strip().endswith("interrupted")


@pytest.mark.parametrize("argv, one_row", [
    (["--regular-decode"], True),  # one prompt, regular decoding: every step one row
    (["--regular-decode", "--prompts-file", "demo/prompts.txt", "--batch-size", "1"], True),
    (["--regular-decode", "--prompts-file", "demo/prompts.txt", "--batch-size", "2"], False),  # batches of rows
    ([], False),  # speculative: the target verifies several rows a step
    (["--prompt-lookup"], False),
])
def test_the_target_is_loaded_for_one_row_a_step_only_when_every_step_decodes_one(monkeypatch, argv, one_row):
    loaded = {}

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        loaded.update(kwargs)
        raise Loaded

    monkeypatch.setattr(main, "load", load)
    with pytest.raises(Loaded):
        main.main(["--demo", *argv])
    assert loaded["one_row"] is one_row


def test_an_option_the_model_refuses_fails_before_anything_is_printed(capsys):
    """--demo's T5 marks no languages: the error comes before the held-out prompt and "Output:", not after."""
    assert main.main(["--demo", "--src-lang", "en_XX", "--max-tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("error: this model's tokenizer marks no languages: it takes no src-lang or tgt-lang\n")


def test_the_loop_refuses_compare_as_the_command_line_does_and_goes_on(monkeypatch, capsys):
    """:compare after :n 2 (or :num-beams 3) is refused in the command
    line's words, with ':' for '--'; it once ended the loop, models and all.
    A prompt after it runs."""
    import io

    from loading import load
    from options import Settings

    lines = iter([":n 2", ":compare", ":n 1", ":num-beams 3", ":compare", ":num-beams 1", "import <extra_id_0>"])

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError

    monkeypatch.setattr("builtins.input", typed)
    out = io.StringIO()
    session = interactive.Session(load(main.DEMO_DIR / "target", draft=main.DEMO_DIR / "draft"), Settings(max_tokens=5), out=out)
    session.run(first_prompt="import <extra_id_0>")
    shown = out.getvalue()
    assert ":n gives several outputs of a prompt: :compare times one" in shown
    assert ":num-beams searches with the target alone: :compare measures speculative decoding" in shown
    assert shown.count("Accepted") == 2  # the first prompt's, and the last's
    for flags, message in ((["--n", "2"], "--n gives several outputs of a prompt: --compare times one"),
                           (["--num-beams", "3"], "--num-beams searches with the target alone: --compare measures")):
        assert main.main(["--demo", "--compare", *flags]) == 2 and message in capsys.readouterr().err


def test_an_error_in_the_loop_is_one_line_and_the_loop_goes_on(monkeypatch):
    """Whatever a line raises that the command line would print as an error, the loop prints and reads on."""
    import io

    from errors import OptionError
    from loading import load
    from options import Settings

    lines = iter(["first", "second"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    session = interactive.Session(load(main.DEMO_DIR / "target"), Settings(max_tokens=3, speculative=False), out=io.StringIO())
    seen = []

    def generate(prompt):
        seen.append(prompt)
        if prompt == "first":
            raise OptionError("no good")
        raise EOFError  # ends the loop as Ctrl-D does

    monkeypatch.setattr(session, "generate", generate)
    with pytest.raises(EOFError):
        session.run()
    assert seen == ["first", "second"] and "error: no good" in session.out.getvalue()
