"""The import picture of pagedserve: no circle between modules or between packages, and the
import rules that each package's docstring states (docs/architecture.md draws the picture).

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


def unit(module: str) -> str:
    """The package (pagedserve.engine) or top-level module (pagedserve.config) of a module."""
    return ".".join(module.split(".")[:2])


def test_no_circle_between_packages() -> None:
    """Packages and top-level modules form layers: no circle even through different modules
    (e.g. engine -> metrics -> engine, which 715470b had)."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(unit(module), set()).update(
            unit(t) for t in targets if unit(t) != unit(module)
        )
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"package circle: {' -> '.join(e.args[1])}") from None


# Modules that import nothing from pagedserve but each other (and torch-free).
LEAVES = {
    "pagedserve.version",
    "pagedserve.envs",
    "pagedserve.errors",
    "pagedserve.param_checks",
    "pagedserve.beam_search_params",
    "pagedserve.sampling_params",
    "pagedserve.structured_outputs_params",
    "pagedserve.config",
    "pagedserve.config_options",  # the option(...) field that declares each option
    "pagedserve.model_config",  # ModelConfig, re-exported by config
    "pagedserve.quant_config",
    "pagedserve.quant_files",
    "pagedserve.outputs",
    "pagedserve.roofline",
    "pagedserve.multimodal",
    "pagedserve.pp_layers",  # the pipeline stages' layer split, for config's checks
    "pagedserve.config_checks",  # config's checks across domains
}
# Never import torch (anywhere in their body, except config's device and GPU-count checks):
# their tests run in milliseconds and the API server's process stays free of model code.
TORCH_FREE = [
    *LEAVES - {"pagedserve.config", "pagedserve.config_checks"},
    "pagedserve.request",
    "pagedserve.step",
    "pagedserve.messages",
    "pagedserve.metrics",
    "pagedserve.metrics_collectors",
    "pagedserve.kv_cache",
    "pagedserve.scheduler",
    "pagedserve.step_plan",
    "pagedserve.models.registry",
    "pagedserve.entrypoints.openai",
]
# What each package must not import (a prefix matches its submodules).
FORBIDDEN = {
    "pagedserve.kv_cache": ["pagedserve.scheduler", "pagedserve.engine", "pagedserve.worker"],
    "pagedserve.scheduler": ["pagedserve.engine", "pagedserve.worker", "pagedserve.executor"],
    "pagedserve.step_plan": ["pagedserve.engine", "pagedserve.worker", "pagedserve.executor"],
    "pagedserve.metrics": ["pagedserve.engine", "pagedserve.entrypoints"],
    "pagedserve.messages": ["pagedserve.engine", "pagedserve.scheduler", "pagedserve.worker"],
    "pagedserve.models": ["pagedserve.worker", "pagedserve.executor", "pagedserve.engine"],
    "pagedserve.layers": ["pagedserve.models", "pagedserve.worker", "pagedserve.engine"],
    "pagedserve.attention": ["pagedserve.layers", "pagedserve.models", "pagedserve.worker"],
    # The engine reaches model code only through the executor (and the torch-free registry).
    "pagedserve.worker": ["pagedserve.executor", "pagedserve.engine", "pagedserve.entrypoints"],
    "pagedserve.executor": ["pagedserve.engine", "pagedserve.entrypoints"],
    "pagedserve.engine": [
        "pagedserve.worker",
        "pagedserve.layers",
        "pagedserve.attention",
        "pagedserve.models.loader",
        "pagedserve.models.llama",
        "pagedserve.entrypoints",
    ],
    "pagedserve.entrypoints": ["pagedserve.executor", "pagedserve.worker", "pagedserve.models"],
}


def test_leaves_import_only_leaves() -> None:
    graph = import_graph()
    broken = [
        f"{leaf} imports {target}"
        for leaf in LEAVES
        for target in graph.get(leaf, set())
        if target not in LEAVES
    ]
    assert broken == []


def test_package_import_rules() -> None:
    broken = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for package, banned in FORBIDDEN.items()
        if in_package(module, package)
        for target in targets
        if any(in_package(target, b) for b in banned)
    ]
    assert broken == []


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` except those under `if TYPE_CHECKING:` (never run)."""
    nodes: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def imports_torch(path: Path) -> bool:
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if any(n == "torch" or n.startswith(("torch.", "triton")) for n in names):
            return True
    return False


def test_torch_free_modules() -> None:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    importing = [
        name
        for name, path in modules.items()
        if any(in_package(name, free) for free in TORCH_FREE) and imports_torch(path)
    ]
    assert importing == []


def test_only_the_root_facade_imports_entrypoints() -> None:
    importers = sorted(
        module
        for module, targets in import_graph().items()
        if module != "pagedserve" and not in_package(module, "pagedserve.entrypoints")
        if any(in_package(t, "pagedserve.entrypoints") for t in targets)
    )
    assert importers == []
