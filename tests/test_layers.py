"""The package's layers as a reader sees them: no import circle, kernels imported by name, small files."""
import ast
from pathlib import Path

EMBER = Path(__file__).parents[1] / "ember"


def _imports(path: Path) -> set[str]:
    """Modules a file imports, at any depth (function-local imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_models_never_reach_up_into_loading():
    for path in (EMBER / "models").glob("*.py"):
        assert not any(n == "ember.loading" or n.startswith("ember.loading.") for n in _imports(path)), path.name


def test_library_code_imports_kernel_modules_by_name():
    """Ops, models and the VAE import ``ember.kernels.<family>`` visibly (after prepare_triton), not through
    ``_dispatch.kernels`` (kept for tests and benchmarks)."""
    for path in EMBER.rglob("*.py"):
        rel = path.relative_to(EMBER)
        if rel.parts[0] in ("bench", "kernels") or rel.name == "_dispatch.py":
            continue
        assert "_dispatch.kernels(" not in path.read_text(), str(rel)


def test_no_module_over_900_lines():
    long = {str(p.relative_to(EMBER)): n for p in EMBER.rglob("*.py") if (n := len(p.read_text().splitlines())) > 900}
    assert long == {}
