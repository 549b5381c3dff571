"""The code's shape, checked: the engine below the front ends, nothing leaning on the benchmarks, units a reader can hold."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))
PROJECT = {p.stem for p in ROOT.glob("*.py")} | {"serving", "bench"}  # what `import X` may name of ours

ENGINE = {"batches", "decoder", "rows", "beams", "drafting", "autodraft", "model", "cache", "attention", "sampling", "rules",
          "options", "errors", "cpu", "kernels"}


def imports(path: Path) -> set[str]:
    """The project's modules a file imports (anywhere in it), by top-level name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & PROJECT


def test_the_engine_imports_neither_the_loader_nor_any_front_end():
    """batches.py (the engine's factory) and all it imports stay within the
    engine: no loading, generate, text, main, interactive, sweep, server or bench."""
    reached, todo = set(), ["batches"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += sorted(imports(ROOT / f"{name}.py"))
    assert reached <= ENGINE, sorted(reached - ENGINE)


def reachable(start: str) -> set[str]:
    reached, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += sorted(imports(ROOT / f"{name}.py"))
    return reached


def test_the_loader_reads_models_and_learns_nothing():
    """loading.py (and all it imports) holds the loaded models apart from what
    decoding learns of them while running: no drafting, no batches."""
    assert not reachable("loading") & {"drafting", "autodraft", "batches", "decoder", "beams", "rows", "generate"}


def module_imports() -> dict[str, set[str]]:
    """Each of the project's modules (serving's and bench's by dotted name) and the project's modules it imports."""
    def name(path: Path) -> str:
        parts = path.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    found = {}
    for path in SOURCES:
        if path.parent.name == "tests" or path.parent.parent.name == "demo":
            continue
        found[name(path)] = ast.parse(path.read_text())
    graph = {}
    for module, tree in found.items():
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(found)
                names |= submodules or {node.module}  # `from bench import fixtures` imports bench.fixtures
        graph[module] = {n for n in names if n in found and n != module}
    return graph


def test_no_modules_import_each_other_in_a_circle():
    """Layers: a module may import those below it, never one that (through others) imports it back."""
    graph, circles = module_imports(), []

    def visit(module, path):
        for imported in sorted(graph[module]):
            if imported in path:
                circles.append(path[path.index(imported):] + [imported])
            elif imported not in done:
                visit(imported, path + [imported])
        done.add(module)

    done = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert circles == [], circles


def test_nothing_but_the_benchmarks_and_their_own_tests_imports_bench():
    """bench/'s harness and its commands are tested (test_bench.py, and
    test_docs.py parses the commands the docs give); nothing else leans on it."""
    leaning = [p.relative_to(ROOT) for p in SOURCES
               if "bench" in imports(p) and p.parent.name != "bench" and p.name not in ("test_bench.py", "test_docs.py")]
    assert leaning == []


def test_no_module_is_over_500_lines_but_the_models_forward_code():
    """A file a newcomer can read top to bottom; model.py, the forward code of every family, may run longer (the
    tests are specifications, read a test at a time)."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in SOURCES
            if p.name != "model.py" and p.parent.name != "tests" and (n := len(p.read_text().splitlines())) > 500]
    assert long == []


def test_no_function_is_over_80_lines():
    """Long functions hide the steps a reader follows."""
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_no_test_sets_a_private_attribute():
    """Tests go through public entry points (EncoderDecoder.compiled, EncoderDecoder.traced_shapes, DraftCost's methods ...)."""
    setting = re.compile(r"\.\_[a-zA-Z]\w*\s*=[^=]|setattr\([^,]+,\s*[\"']_[a-zA-Z]")
    found = [f"{p.name}:{i}" for p in (ROOT / "tests").glob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if setting.search(line)]
    assert found == []


def test_pip_install_makes_every_module_importable():
    """pyproject.toml lists every top-level module (and serving/) for `pip install -e .`."""
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(listed["py-modules"]) == {p.stem for p in ROOT.glob("*.py")} and listed["packages"] == ["serving"]


def test_no_tracked_file_is_ignored():
    done = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "", done.stdout


def test_the_tests_the_second_pass_leaves_to_the_first_exist():
    """conftest's CPU_PASS_TESTS names test_whisper.py's tests: a renamed one would run in both passes unnoticed."""
    from conftest import CPU_PASS_TESTS

    defined = set(re.findall(r"^def (test_\w+)", (ROOT / "tests" / "test_whisper.py").read_text(), re.M))
    assert CPU_PASS_TESTS <= defined, sorted(CPU_PASS_TESTS - defined)
