"""The package's layers (docs/architecture.md): a module imports only from its own layer or lower ones, and the
module import graph has no circle. Read from the source with ast, so that imports inside functions (lazy ones) and
under `if TYPE_CHECKING:` count as much as those at the top."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, subprocess_env

PACKAGE = ROOT / "transformer"
# Lowest first: core is the package's top-level modules (errors, config, files, run_dir, device, peak, distributed,
# signals).
LAYERS = {"core": 0, "data": 1, "model": 2, "inference": 3, "training": 4, "serve": 5, "visualize": 5, "cli": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] == "__main__":
        return LAYERS["cli"]  # `python -m transformer` is the command line
    return LAYERS[parts[1]] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else LAYERS["core"]


def imported(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module of the package imported, line) for every import statement of the file, wherever it stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from P import m` imports module P.m when there is one, else a name from P
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name == "transformer" or name.startswith("transformer.")]
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    found = modules()
    known = set(found)
    edges = {}
    for module, path in found.items():
        targets = []
        for name, line in imported(module, path, known):
            while name not in known:  # transformer.x.NAME where NAME is no module: the module transformer.x
                name = name.rpartition(".")[0]
            if name != module:
                targets.append((name, line))
        edges[module] = targets
    return edges


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{module}:{line} imports {target}"
        for module, targets in graph().items()
        for target, line in targets
        if layer(target) > layer(module)
    ]
    assert not upward, "imports of a higher layer (docs/architecture.md):\n" + "\n".join(upward)


def test_the_import_graph_has_no_circle():
    edges = {m: sorted({t for t, _ in targets}) for m, targets in graph().items()}
    # a subpackage's __init__ is imported on the way to any of its modules, never the other way round
    state, circles = {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in edges[module]:
            if state.get(target) == "open":
                circles.append(
                    " -> ".join(path[path.index(target) :] + [module, target])
                    if target in path
                    else f"{module} -> {target}"
                )
            elif target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in edges:
        if module not in state:
            visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checks_see_every_kind_of_import(tmp_path):
    """The parser itself: function-level, relative and absolute imports are all found, so a violation cannot hide."""
    source = tmp_path / "transformer" / "data" / "probe.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import transformer.model.transformer\n"
        "def f():\n    from ..training import loop\n    from . import batch\n"
        "    from transformer.cli.commands import x\n",
        encoding="utf-8",
    )
    known = {
        "transformer.model.transformer",
        "transformer.training.loop",
        "transformer.data.batch",
        "transformer.cli.commands",
        "transformer.data.probe",
    }
    names = sorted(name for name, _ in imported("transformer.data.probe", source, known))
    assert names == [
        "transformer.cli.commands",
        "transformer.data.batch",
        "transformer.model.transformer",
        "transformer.training.loop",
    ]
    assert [layer(n) for n in names] == [6, 1, 2, 4]


def test_config_loads_without_torch(tmp_path):
    """Reading and checking a config (what --help, `transformer prepare`'s checks and a config typo meet first)
    does not pay for importing torch."""
    path = tmp_path / "c.yaml"
    path.write_text("model: {d_model: 32, n_heads: 2}\ntrain: {max_steps: 5}\n", encoding="utf-8")
    code = (
        "import sys\nfrom transformer.config import load_config\n"
        f"cfg = load_config({str(path)!r})\nassert cfg.model.d_model == 32 and cfg.train.max_steps == 5\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'sentencepiece') if m in sys.modules)\n"
        "print(' '.join(heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "torch" not in done.stdout.split(), f"importing transformer.config loaded: {done.stdout}"


def test_subpackages_say_what_they_are_and_import_nothing_heavy():
    """Each subpackage's __init__ is a one-line docstring (cli's also names main): importing a package on the way
    to a torch-free module costs nothing."""
    inits = sorted(PACKAGE.glob("*/__init__.py"))
    assert {p.parent.name for p in inits} == set(LAYERS) - {"core"}
    for path in inits:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc and "\n" not in doc, path
    code = (
        "import sys\nimport transformer.data, transformer.model, transformer.inference, transformer.training, "
        "transformer.serve, transformer.visualize, transformer.cli\nprint('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_the_entry_point_and_python_m_reach_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from transformer import cli
    from transformer.__main__ import main as dunder_main

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    module, _, name = scripts["transformer"].partition(":")
    assert (module, name) == ("transformer.cli", "main") and cli.main is dunder_main
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert packages["packages"]["find"]["include"] == ["transformer*"]
    patterns = packages["package-data"]["transformer.serve"]
    assert all(list((PACKAGE / "serve").glob(pattern)) for pattern in patterns)


MAX_MODULE_LINES = 700  # a module past it holds more than one concept
MAX_FUNCTION_LINES = 80  # a function past it, more than one step: name them


def test_no_module_is_over_700_lines_and_no_function_over_80():
    """One concept a module, named steps in a function: every module of the package within MAX_MODULE_LINES, and
    every function of the package and of scripts/ within MAX_FUNCTION_LINES, counted from its def to its last line."""
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        if path.is_relative_to(PACKAGE) and len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno}: {node.name} has {lines} lines")
    assert not found, found


# Test files of a package's tests/ folder that are about the package as a whole, not one module.
WHOLE_PACKAGE_TESTS = {"tests/core/test_layers.py"}


def test_every_module_has_a_test_file_of_its_own_and_every_test_file_a_module():
    """tests/<package>/test_<module>.py (the package's top-level modules: tests/core/), as docs/architecture.md says;
    tests/integration/ holds what crosses modules (crashes, CUDA, torchrun, scripts, the docs, end to end)."""
    expected = {}
    for module in modules():
        parts = module.split(".")
        if parts[-1].startswith("__") or len(parts) == 1 or (len(parts) == 2 and parts[1] in LAYERS):
            continue  # the package and its subpackages' __init__, __main__
        package = parts[1] if len(parts) > 2 else "core"
        expected[f"tests/{package}/test_{parts[-1]}.py"] = module
    found = {str(p.relative_to(ROOT)) for folder in LAYERS for p in (ROOT / "tests" / folder).glob("test_*.py")}
    missing = sorted(f"{expected[t]}: {t}" for t in set(expected) - found)
    strays = sorted(found - set(expected) - WHOLE_PACKAGE_TESTS)
    assert not missing, "modules without a test file of their own:\n" + "\n".join(missing)
    assert not strays, "test files named after no module (rename, or move into the module's file):\n" + "\n".join(
        strays
    )
