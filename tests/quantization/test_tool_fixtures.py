"""Checkpoints made by the formats' own tools (GPTQModel, AutoAWQ; fixtures/, made by
fixtures/make_fixtures.py on the CPU) load here as the tools meant them:

- our dequantized weights, read through the loader into the fused layers, equal the tool's
  own dequantization (recorded in each fixture, float16) after rounding ours to float16;
- greedy output of `LLM` equals transformers running the tool-dequantized weights (float32),
  and the tool's own greedy output (its CPU kernels, recorded in the fixture).
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from pagedserve.engine.arg_utils import load_hf_config
from pagedserve.models.loader import load_model
from tests.entrypoints.test_llm_greedy import hf_greedy

from .test_gptq_models import llm_greedy

FIXTURES = Path(__file__).parent / "fixtures"
# fixture -> the method the engine must detect from its config.json
TOOL_FIXTURES = {
    "gptqmodel-4bit-g32-actorder-asym": "gptq",
    "gptqmodel-8bit-g64-sym": "gptq",
    "autoawq-4bit-g32-gemm": "awq",
}
# our fused layer -> the checkpoint's linears it holds, in output order
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def recorded_greedy(folder: Path) -> tuple[list[list[int]], list[list[int]]]:
    data = json.loads((folder / "tool_greedy.json").read_text())
    return data["prompts"], data["outputs"]


@pytest.mark.parametrize("name", sorted(TOOL_FIXTURES))
def test_our_dequantization_equals_the_tools(name: str) -> None:
    folder = FIXTURES / name
    hf_config = load_hf_config(str(folder))
    model = load_model(
        str(folder), hf_config, torch.float32, torch.device("cpu"), "auto", TOOL_FIXTURES[name]
    )
    tool = load_file(folder / "tool_dequantized.safetensors")
    assert len(tool) == 7 * hf_config.num_hidden_layers
    compared = 0
    for i, layer in enumerate(model.model.layers):
        for fused, parts in FUSED.items():
            module = layer.get_submodule(fused)
            ours = module.quant_method.dequantize(module)  # W^T [K, sum of N]
            expected = [tool[f"model.layers.{i}.{part}"] for part in parts]
            assert ours.shape == (expected[0].shape[0], sum(t.shape[1] for t in expected))
            pieces = ours.split([t.shape[1] for t in expected], dim=1)
            for got, want in zip(pieces, expected, strict=True):
                # the tools dequantize in float16: scale * (q - zero) rounded once
                assert torch.equal(got.to(torch.float16), want), f"{name}: layer {i} {fused}"
                compared += 1
    assert compared == len(tool)


@pytest.mark.parametrize("name", sorted(TOOL_FIXTURES))
def test_llm_greedy_equals_transformers_on_the_tool_dequantized_weights(
    name: str, tmp_path: Path
) -> None:
    folder = FIXTURES / name
    prompts, tool_outputs = recorded_greedy(folder)
    # transformers' model of the same architecture, with the checkpoint's other tensors and
    # the tool-dequantized linears as float weights
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    state = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    for prefix, w_t in load_file(folder / "tool_dequantized.safetensors").items():
        for field in ("qweight", "qzeros", "scales", "g_idx"):
            state.pop(f"{prefix}.{field}", None)
        state[f"{prefix}.weight"] = w_t.float().T
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    hf_model.tie_weights()
    hf_model.save_pretrained(tmp_path / "dequantized")
    expected = hf_greedy(tmp_path / "dequantized", prompts, 10)
    ours = llm_greedy(folder, None, TOOL_FIXTURES[name], prompts)
    assert ours == expected
    assert ours == tool_outputs
