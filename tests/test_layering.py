"""The layering of the repository, read from the imports: arrows point down only.

kroquant_jax (pure math) <- pallas_kernels (GPU kernels) <- models (ports, assembly) <- scripts (command-line mains);
benchmarks/ and tests/ sit on top: the library never imports them, tests load no benchmark module (running one as a
subprocess is fine) and benchmarks import neither each other nor tests nor private names of the library.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kroquant_jax", "pallas_kernels", "models", "scripts")
FORBIDDEN = {
    "kroquant_jax": {"pallas_kernels", "models", "scripts", "benchmarks", "tests"},
    "pallas_kernels": {"models", "scripts", "benchmarks", "tests"},
    "models": {"scripts", "benchmarks", "tests"},
    "scripts": {"benchmarks", "tests"},
}
BENCHMARK_MODULES = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import statement in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names], node.lineno))
    return found


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


@pytest.mark.parametrize("package", PACKAGES)
def test_library_layers_point_down(package):
    bad = []
    for path in _files(package):
        for module, _, line in _imports(path):
            top = module.split(".")[0]
            if top in FORBIDDEN[package] or top in BENCHMARK_MODULES:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_tests_load_no_benchmark_module():
    bad = []
    for path in _files("tests"):
        text = path.read_text()
        for module, _, line in _imports(path):
            if module.split(".")[0] in BENCHMARK_MODULES | {"benchmarks"}:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
        if path.name != "test_layering.py" and "spec_from_file_location" in text and "benchmarks" in text:
            bad.append(f"{path.relative_to(ROOT)} loads a benchmark file as a module")
    assert not bad, "\n".join(bad)


def _private_attributes(path: Path) -> list[str]:
    """``alias._name`` uses in ``path`` where ``alias`` is a module of the library imported under that name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PACKAGES:
            aliases |= {a.asname or a.name for a in node.names}
    return [f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def test_benchmarks_import_no_benchmark_test_or_private_name():
    bad = []
    for path in _files("benchmarks"):
        bad += _private_attributes(path)
        for module, names, line in _imports(path):
            top = module.split(".")[0]
            if top in (BENCHMARK_MODULES - {path.stem}) | {"tests", "benchmarks"}:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            private = [n for n in names if n.startswith("_")] + [p for p in module.split(".") if p.startswith("_")]
            if top in PACKAGES and private:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports private {module}: {private}")
    assert not bad, "\n".join(bad)


def test_no_private_jax_modules():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for folder in PACKAGES + ("benchmarks",)
           for p in _files(folder) for m, _, line in _imports(p) if m.startswith("jax._src")]
    assert not bad, "\n".join(bad)
