"""The README and docs: every file they name exists, every command they give parses, every figure of
docs/PERFORMANCE.md and the README's tables is what bench/results/ renders, and the README stays short."""

import re
import shlex
from pathlib import Path

import pytest

import main

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "requirements.txt", ROOT / ".ci" / "run"]


def commands(program: str) -> list[list[str]]:
    """Every `python PROGRAM ...` in the texts, as arguments (comments and shell continuations dropped)."""
    found = []
    for text in TEXTS:
        for line in text.read_text().splitlines():
            for match in re.finditer(rf"python3? {re.escape(program)} ?([^`#\n]*)", line):
                found.append(shlex.split(match.group(1).replace("\\", "")))
    return found


@pytest.mark.parametrize("text", TEXTS, ids=lambda path: path.name)
def test_every_python_file_a_text_names_exists(text):
    """requirements.txt once named a blas.py there never was."""
    named = set(re.findall(r"(?<![\w/.])([a-z][a-z0-9_]*\.py)\b", text.read_text()))
    folders = [ROOT] + [ROOT / name for name in ("demo", "tests", "serving", "bench")]
    files = {path.name for folder in folders for path in folder.glob("*.py")}
    assert named <= files, sorted(named - files)


def test_every_main_py_command_in_the_texts_parses():
    parser = main.build_parser()
    given = commands("main.py")
    assert len(given) > 10
    for argv in given:
        parser.parse_args(argv)  # exits (SystemExit) on an unknown option


def test_every_server_py_command_in_the_texts_parses():
    import server

    parser = server.build_parser()
    given = commands("server.py")
    assert len(given) >= 3
    for argv in given:
        parser.parse_args(argv)


def test_every_bench_command_in_the_texts_and_the_results_parses():
    from bench import __main__ as bench_main
    from bench import render

    parser = bench_main.build_parser()
    written = [*render.results().values(), *render.results(gpu=True).values()]
    given = commands("-m bench") + [shlex.split(r["command"].removeprefix("python -m bench")) for r in written]
    assert len(given) > 10
    for argv in given:
        parser.parse_args(argv)
    assert not commands("bench.py"), "bench is a folder: python -m bench"


def test_the_quantization_choices_the_readme_gives_are_convert_pys():
    """It once said `--q-bits 2-8`, and 7 was refused."""
    import convert

    text = " ".join((ROOT / "README.md").read_text().split())
    for flag, choices in (("--q-bits", convert.Q_BITS), ("--q-group-size", convert.Q_GROUP_SIZES)):
        given = re.search(rf"`{flag}` ([\d, or]+?) \(default", text)
        assert given and tuple(map(int, re.findall(r"\d+", given.group(1)))) == choices, flag


def test_performance_and_the_readmes_tables_are_what_the_results_render():
    """Every figure there comes from a JSON result a bench command wrote:
    `python -m bench render` writes them, and nothing else may."""
    from bench import COMMANDS, render

    found = render.results()
    assert set(found) == set(COMMANDS), "every command's result is in PERFORMANCE.md"
    assert (ROOT / "docs" / "PERFORMANCE.md").read_text() == render.performance(found, render.results(gpu=True))
    assert (ROOT / "README.md").read_text() == render.readme_with(render.readme_tables(found))


def test_the_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_what_pip_install_e_leaves_behind_is_ignored_by_git():
    """The README suggests `pip install -e .`: its egg-info folder (from
    pyproject.toml's name) would otherwise show as untracked."""
    import subprocess

    name = re.search(r'^name = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1).replace("-", "_")
    done = subprocess.run(["git", "check-ignore", "-q", f"{name}.egg-info/PKG-INFO"], cwd=ROOT)
    assert done.returncode == 0, f"{name}.egg-info/ is not in .gitignore"


def test_servingmd_lists_every_bound_a_request_is_held_to():
    """docs/SERVING.md names each of serving.schema.BOUNDS, in its words."""
    from serving.schema import BOUNDS

    text = " ".join((ROOT / "docs" / "SERVING.md").read_text().split())
    for name, bound in BOUNDS.items():
        assert f"`{name}` {bound}" in text, name
