"""The import picture of pagedserve: no circle between modules, and the packages' import rules
(the docstrings of `pagedserve/worker/__init__.py` and `pagedserve/executor/__init__.py`).

Read from the source (every import statement, those inside functions too: a function-level
import is how a circle hides), so nothing is imported and the test takes milliseconds.
"""

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each pagedserve module -> the pagedserve modules it imports (anywhere in its body)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    package = name.split(".")[: len(name.split(".")) - node.level]
                    package += [name.split(".")[-1]] if path.name == "__init__.py" else []
                    base = ".".join(package + ([base] if base else []))
                # `from a import b` imports module a.b when there is one, else a's name b
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    imported.add(submodule if submodule in modules else base)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def test_no_import_circle() -> None:
    """A circle would make the import order matter (a half-initialised module)."""
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_worker_and_executor_import_rules() -> None:
    """The engine reaches the ranks only through the executor; what runs on a rank knows
    neither."""
    forbidden = {
        "pagedserve.worker": ["pagedserve.executor", "pagedserve.engine", "pagedserve.entrypoints"],
        "pagedserve.executor": ["pagedserve.engine", "pagedserve.entrypoints"],
        "pagedserve.engine": ["pagedserve.worker"],
    }
    broken = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for package, banned in forbidden.items()
        if in_package(module, package)
        for target in targets
        if any(in_package(target, b) for b in banned)
    ]
    assert broken == []
