"""Structured outputs on the GPU: xgrammar's CUDA kernel applies the bitmask, which is
filled while the forward runs (async scheduling, CUDA graphs); the outputs equal the CPU
engine's and obey their constraints."""

import json
import re
from pathlib import Path

import jsonschema
import pytest

from pagedserve import SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams
from tests.structured_output.conftest import build_tiny_qwen3, make_llm

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "n"],
}


def test_constrained_outputs_on_cuda_equal_the_cpu_run(tmp_path: Path) -> None:
    model = build_tiny_qwen3(tmp_path / "model")
    constraints = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(regex=r"(ab|cd){3,6}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        None,
    ]
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=c) for c in constraints
    ] * 8  # 32 requests: several constrained rows per step
    prompts = [f"prompt {i}" for i in range(len(params))]

    def run(**kwargs: object) -> list[str]:
        llm = make_llm(model, **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        return [o.outputs[0].text for o in outputs]

    cpu = run(device="cpu")
    for text, c in zip(cpu, params, strict=True):
        if c.structured_outputs is not None and c.structured_outputs.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif c.structured_outputs is not None and c.structured_outputs.regex is not None:
            assert re.fullmatch(r"(ab|cd){3,6}", text)
        elif c.structured_outputs is not None:
            assert text in ("yes", "no", "maybe")
    assert run(device="cuda", dtype="float32") == cpu  # async scheduling, CUDA graphs
    assert run(device="cuda", dtype="float32", async_scheduling=False) == cpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # xgrammar's kernel; the torch path
@pytest.mark.parametrize("constrained", [["e", "a", "c"], ["a", "b", "c", "d", "e"]])
def test_bitmask_on_cuda_equals_the_cpu_path(dtype: str, constrained: list[str]) -> None:
    """Constrained rows out of batch order (xgrammar's kernel reads bitmask row i for logits
    row i: the compact rows must land in a full-batch mask), every row constrained in order
    (the bitmask goes to the kernel as it is), and a padded vocabulary."""
    import torch

    from pagedserve.step import GrammarOutput
    from pagedserve.worker.grammar_bitmask import apply_grammar_bitmask

    torch.manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(constrained), 10), dtype=torch.int32)
    grammar = GrammarOutput(constrained, bitmask.numpy())
    logits = torch.randn(5, 330, dtype=getattr(torch, dtype))  # wider than the mask's 320 bits
    expected = logits.clone()
    apply_grammar_bitmask(expected, grammar, ["a", "b", "c", "d", "e"])
    on_cuda = logits.cuda()
    apply_grammar_bitmask(on_cuda, grammar, ["a", "b", "c", "d", "e"])
    assert torch.equal(on_cuda.cpu(), expected)
