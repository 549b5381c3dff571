"""The README and docs: every file they name exists, every command they give parses, and the README stays short."""

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
            for match in re.finditer(rf"python3? {program} ?([^`#\n]*)", line):
                found.append(shlex.split(match.group(1).replace("\\", "")))
    return found


@pytest.mark.parametrize("text", TEXTS, ids=lambda path: path.name)
def test_every_python_file_a_text_names_exists(text):
    """requirements.txt once named a blas.py there never was."""
    named = set(re.findall(r"(?<![\w/.])([a-z][a-z0-9_]*\.py)\b", text.read_text()))
    files = {path.name for path in (*ROOT.glob("*.py"), *ROOT.glob("demo/*.py"), *ROOT.glob("tests/*.py"))}
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


def test_every_bench_py_command_in_the_texts_parses():
    import bench

    parser = bench.build_parser()
    given = commands("bench.py")
    assert len(given) > 10
    for argv in given:
        parser.parse_args(argv)


def test_the_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
