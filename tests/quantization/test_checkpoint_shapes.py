"""A checkpoint tensor of the wrong shape is refused with an error naming the tensor and both
shapes (issue 15), on every kind of weight loader: fused (q/k/v) column shards, row-parallel
replicated scales, the act-order g_idx that gate/up share, and plain replicated tensors.
A [1]-sized tensor must not be broadcast into the parameter by `copy_`."""

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.engine.model_files import load_hf_config
from pagedserve.errors import UnsupportedModelError
from pagedserve.models.loader import load_model

FIXTURE = Path(__file__).parent / "fixtures" / "gptqmodel-4bit-g32-actorder-asym"


@pytest.mark.parametrize(
    ("name", "keep_rows"),
    [
        ("model.layers.0.self_attn.k_proj.qweight", -1),  # a shard of the fused qkv_proj
        ("model.layers.0.mlp.down_proj.scales", -1),  # replicated (act-order row-parallel)
        ("model.layers.1.mlp.up_proj.g_idx", 1),  # shared with gate_proj: was "different"
        ("model.layers.1.mlp.up_proj.g_idx", -1),  # was torch's RuntimeError, no name
        ("model.norm.weight", 1),  # was broadcast-checked only by the default loader
    ],
)
def test_a_wrong_shape_names_the_tensor_and_both_shapes(
    tmp_path: Path, name: str, keep_rows: int
) -> None:
    for file in ("config.json", "quantize_config.json"):
        shutil.copy(FIXTURE / file, tmp_path)
    tensors = load_file(FIXTURE / "model.safetensors")
    good = tuple(tensors[name].shape)
    tensors[name] = tensors[name][:keep_rows].contiguous()
    bad = tuple(tensors[name].shape)
    save_file(tensors, tmp_path / "model.safetensors")
    hf_config = load_hf_config(str(tmp_path))
    with pytest.raises(UnsupportedModelError) as raised:
        load_model(str(tmp_path), hf_config, torch.float32, torch.device("cpu"), "auto", "gptq")
    message = str(raised.value)
    assert f"checkpoint tensor {name!r}" in message
    assert re.search(rf"{re.escape(str(bad))}.*{re.escape(str(good))}", message), message
