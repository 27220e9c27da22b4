"""Each rank reads only its shard of every checkpoint tensor, and gets the right shard."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.distributed.parallel_state import set_tensor_parallel_state
from pagedserve.models import loader
from pagedserve.models.loader import SafetensorsSlice, load_model

from ._helpers import CONFIGS, REAL_MODELS, SHARED_MODELS, save_tiny_model


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[torch.Tensor, SafetensorsSlice]]:
    full = torch.randn(6, 10)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        yield full, SafetensorsSlice(f.get_slice("w"))


def test_slice_views_read_what_torch_views_hold(
    stored: tuple[torch.Tensor, SafetensorsSlice],
) -> None:
    full, view = stored
    assert view.shape == full.shape and view.dtype == torch.float32 and view.size(-1) == 10
    assert torch.equal(view.narrow(1, 4, 3).materialize(), full.narrow(1, 4, 3))
    assert torch.equal(view.t().narrow(0, 2, 5).materialize(), full.t().narrow(0, 2, 5))
    for ours, theirs in zip(view.t().chunk(3, dim=1), full.t().chunk(3, dim=1), strict=True):
        assert ours.shape == theirs.shape and torch.equal(ours.materialize(), theirs)
    assert view.narrow(0, 6, 0).materialize().shape == (0, 10)
    target = torch.zeros(2, 10, dtype=torch.float64)
    target.copy_(view.narrow(0, 1, 2))  # a torch function reads the view's window
    assert torch.equal(target, full[1:3].double())
    with pytest.raises(IndexError):
        view.narrow(0, 5, 2)


def _load_as_rank(path: Path, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    hf_config = transformers.AutoConfig.from_pretrained(path)
    set_tensor_parallel_state(tp_rank, tp_size)
    try:
        model = load_model(str(path), hf_config, torch.float32, torch.device("cpu"))
    finally:
        set_tensor_parallel_state(0, 1)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS) + list(REAL_MODELS))
def test_rank_reads_only_its_shard(
    name: str, tp_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's parameters equal those loaded from whole tensors (the loaders' own
    narrowing), while the lazy path reads about 1/tp_size of the checkpoint."""
    path = SHARED_MODELS / name if name in REAL_MODELS else save_tiny_model(name, tmp_path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        num_stored = sum(_numel(f, key) for key in f.keys())  # noqa: SIM118
    num_read = 0
    materialize = SafetensorsSlice.materialize

    def counting_materialize(self: SafetensorsSlice) -> torch.Tensor:
        nonlocal num_read
        tensor = materialize(self)
        num_read += tensor.numel()
        return tensor

    for rank in range(tp_size):
        num_read = 0
        with monkeypatch.context() as patch:
            patch.setattr(SafetensorsSlice, "materialize", counting_materialize)
            lazy = _load_as_rank(path, rank, tp_size)
        with monkeypatch.context() as patch:  # whole tensors, narrowed by the weight loaders
            patch.setattr(loader, "iterate_safetensor_slices", loader.iterate_safetensors)
            eager = _load_as_rank(path, rank, tp_size)
        assert lazy.keys() == eager.keys()
        for param_name in lazy:
            assert torch.equal(lazy[param_name], eager[param_name]), param_name
        assert num_read < num_stored * (1 / tp_size + 0.1), (num_read, num_stored)


def _numel(f: object, key: str) -> int:
    numel = 1
    for size in f.get_slice(key).get_shape():  # type: ignore[attr-defined]
        numel *= size
    return numel
