"""transformers' activation table, loaded on first use while a model's config loads.

With torch installed, transformers' config modules (Llama's and most others, through
`transformers.utils.type_validators`) import `transformers.activations` for its `ACT2FN`
table, and that module imports the kernel hub integration, the checkpoint conversion mapping
and `core_model_loading`, which import torch.distributed.tensor (and with it sympy): 0.7 s of
the 1.4 s config step on the development CPU, 2.5 s of the 6 s on the H200 host, on the
critical path of the server's start (BENCHMARKS.md, issue 20). A config reads ACT2FN only to
check an activation name (`type_validators.activation_fn_key`, which Llama's config does not
use), and our native models never import transformers' modeling code, so the engine need not
pay for it. `activations_deferred` puts a stand-in module in its place while the config loads:
its `ACT2FN` imports the real module on first use, as does any other name read from it, so every
config loads and checks as before. Import rule: a leaf (imports nothing from pagedserve).
"""

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator, KeysView, Mapping
from typing import Any

ACTIVATIONS = "transformers.activations"


def _real_activations() -> types.ModuleType:
    """The real `transformers.activations`, imported now (in place of the stand-in) if it is
    not yet."""
    if isinstance(sys.modules.get(ACTIVATIONS), _DeferredActivations):
        del sys.modules[ACTIVATIONS]
    return importlib.import_module(ACTIVATIONS)


class _DeferredACT2FN(Mapping[str, Any]):
    """`ACT2FN` of the real module (activation name -> a new instance of its nn.Module),
    imported on first use."""

    def _table(self) -> Mapping[str, Any]:
        table: Mapping[str, Any] = _real_activations().ACT2FN
        return table

    def __getitem__(self, name: str) -> Any:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __contains__(self, name: object) -> bool:
        return name in self._table()

    def keys(self) -> KeysView[str]:
        return self._table().keys()


class _DeferredActivations(types.ModuleType):
    """The stand-in: `ACT2FN` is a `_DeferredACT2FN`; any other public name imports the real
    module and is read from it."""

    ACT2FN: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # what the import system probes (__path__, __spec__, ...)
            raise AttributeError(name)
        return getattr(_real_activations(), name)


@contextlib.contextmanager
def activations_deferred() -> Iterator[None]:
    """While it lasts, importing `transformers.activations` gives the stand-in unless the
    real module is imported already. What imports it meanwhile keeps the stand-in's ACT2FN
    (which reads the real table once it is first used); afterwards the name imports
    normally."""
    if ACTIVATIONS in sys.modules:
        yield
        return
    stand_in = _DeferredActivations(
        ACTIVATIONS, "stand-in (pagedserve.engine.deferred_activations)"
    )
    stand_in.ACT2FN = _DeferredACT2FN()
    sys.modules[ACTIVATIONS] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(ACTIVATIONS) is stand_in:
            del sys.modules[ACTIVATIONS]
