"""CPU weight offload (vLLM's `cpu_offload_gb`): the weights of the first layers of the
model's layer stacks live in (pinned) CPU memory and are copied to the device layer by layer
as the forward reaches them, the next offloaded layer's copy overlapping the current layer's
compute, so that a model larger than the device's memory runs (at PCIe speed for those bytes).

How (vLLM offloads parameters as `make_layers` builds each layer; this does the same without
touching the models):
- While the model is built, a module-registration hook sees every layer put into an
  `nn.ModuleList` (a decoder layer stack, CLIP's encoder layers) and, while the budget
  lasts, moves that layer's parameters to the host right after the layer is built, so the
  device never holds more than one layer of them. Weight loading then writes into the host
  tensors.
- Each offloaded layer gets a forward pre-hook: it waits for its own copy (started by the
  previous offloaded layer's pre-hook on a side stream), points the parameters at the device
  copies, and starts the copy of the next offloaded layer (cyclically: the last one fetches
  the first of its own layer stack for the next step, as a vision-language model's vision
  layers run only in the steps with an image). A forward hook points the parameters back at the host
  tensors, so at most two offloaded layers' weights are on the device at a time.
- The hooks are Python code around each forward, so the decode CUDA graphs are not captured
  with offload on (the step is bound by the copies anyway: PCIe moves ~50 GB/s).
On a CPU device the "device copy" is a clone of the host tensor, so that the same code runs
(and is tested) without a GPU.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)

_Fetch = tuple[dict[str, torch.Tensor], torch.cuda.Event | None]


class CpuOffloader:
    """Offloads up to `budget_bytes` of parameters, whole layers in build order.

    Use: `with offloader.building(): model = Model(...)`, load the weights, then
    `offloader.attach()`. `modules` are the offloaded layers, `offloaded_bytes` their
    parameters' bytes, `num_fetches` the layer copies made so far (tests read it)."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"cpu offload needs a positive budget, got {budget_bytes} bytes")
        self.budget_bytes = budget_bytes
        self.device = device
        self.modules: list[nn.Module] = []
        self.offloaded_bytes = 0
        self.num_fetches = 0
        self._host: list[dict[str, torch.Tensor]] = []
        self._pending: dict[int, _Fetch] = {}
        self._offloaded: set[int] = set()  # id() of the offloaded parameters
        self._stacks: list[int] = []  # id() of each offloaded layer's ModuleList
        self._handles: list[RemovableHandle] = []
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    @contextmanager
    def building(self) -> Iterator[None]:
        """Offload layers as they are registered into a ModuleList during the block."""

        def on_register(parent: nn.Module, name: str, module: nn.Module | None) -> None:
            if isinstance(parent, nn.ModuleList) and module is not None:
                self._offload(module, parent)

        handle = nn.modules.module.register_module_module_registration_hook(on_register)
        try:
            yield
        finally:
            handle.remove()

    def _offload(self, module: nn.Module, stack: nn.ModuleList) -> None:
        if self.offloaded_bytes >= self.budget_bytes:
            return
        params = dict(module.named_parameters())
        if not params or any(id(p) in self._offloaded for p in params.values()):
            return  # no weights, or it holds layers offloaded already (nested ModuleLists)
        host: dict[str, torch.Tensor] = {}
        for name, param in params.items():
            tensor = param.data.to("cpu")
            if self.device.type == "cuda":
                tensor = tensor.pin_memory()
            param.data = tensor
            host[name] = tensor
            self._offloaded.add(id(param))
            self.offloaded_bytes += tensor.numel() * tensor.element_size()
        self.modules.append(module)
        self._host.append(host)
        self._stacks.append(id(stack))

    def attach(self) -> None:
        """Install the fetch hooks (after the weights are loaded into the host tensors)."""
        for index, module in enumerate(self.modules):
            # Weight loading may have replaced a parameter's tensor (e.g. a repacking hook):
            # the host copy is whatever the parameter holds now.
            self._host[index] = {name: p.data for name, p in module.named_parameters()}
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(module.register_forward_hook(self._post_hook(index)))
        logger.info(
            "cpu offload: %.2f GiB of weights (%d layers) in %s CPU memory",
            self.offloaded_bytes / 2**30,
            len(self.modules),
            "pinned" if self.device.type == "cuda" else "plain",
        )

    def _fetch(self, index: int) -> _Fetch:
        """Start copying layer `index`'s parameters to the device (side stream on CUDA)."""
        self.num_fetches += 1
        host = self._host[index]
        if self._stream is None:
            return {name: t.clone() for name, t in host.items()}, None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            tensors = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return tensors, event

    def _pre_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            pending = self._pending.pop(index, None)
            tensors, event = pending if pending is not None else self._fetch(index)
            if event is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(event)
                for tensor in tensors.values():
                    # Allocated on the side stream, used on this one: the allocator must not
                    # hand the memory out again before this stream is done with it.
                    tensor.record_stream(current)
            for name, param in module.named_parameters():
                param.data = tensors[name]
            following = self._following(index)
            if following != index and following not in self._pending:
                self._pending[following] = self._fetch(following)

        return hook

    def _following(self, index: int) -> int:
        """The offloaded layer that the forward reaches after layer `index`: the next one
        built; after the last one, the first one of its stack, which runs every step (a
        vision-language model's vision layers, built before its language model's, run only
        in the steps that encode an image)."""
        if index + 1 < len(self.modules):
            return index + 1
        return self._stacks.index(self._stacks[index])

    def _post_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            host = self._host[index]
            for name, param in module.named_parameters():
                param.data = host[name]

        return hook
