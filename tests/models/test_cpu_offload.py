"""CPU weight offload (`cpu_offload_gb`, pagedserve/models/cpu_offload.py): greedy output
equals the run without offload, with part and with all of the layers offloaded, and the
layers' weights are fetched once per offloaded layer per forward."""

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models.cpu_offload import CpuOffloader

MODEL = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260k"  # 5 layers
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def layer_bytes() -> int:
    """The parameter bytes of one of stories260k's (equal) decoder layers, float32."""
    from safetensors import safe_open

    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.startswith("model.layers.0.")]  # noqa: SIM118
        return sum(f.get_tensor(n).numel() * 4 for n in names)


def offloader(llm: LLM) -> Any:
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    return getattr(model, "cpu_offloader", None)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM(str(MODEL), seed=0)
    assert offloader(llm) is None
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("num_layers", [2, 5])
def test_greedy_output_unchanged(expected: list[list[int]], num_layers: int) -> None:
    # A budget of 1.5 layers offloads 2 (whole layers while the budget lasts); 100 layers'
    # worth offloads all 5.
    budget = layer_bytes() * (1.5 if num_layers == 2 else 100)
    llm = LLM(str(MODEL), seed=0, cpu_offload_gb=budget / 2**30)
    offload = offloader(llm)
    assert len(offload.modules) == num_layers
    assert (
        offload.modules[0]
        is llm.llm_engine.engine_core.executor.worker.runner.model.model.layers[0]
    )
    before = offload.num_fetches
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    # Every forward fetched each offloaded layer once (the next step's first layer may be
    # prefetched already): at least one fetch per layer per step of 16 tokens.
    assert offload.num_fetches - before >= num_layers * GREEDY.max_tokens


def test_parameters_point_back_at_the_host_copies_between_forwards() -> None:
    layers = torch.nn.ModuleList()
    offload = CpuOffloader(1, torch.device("cpu"))
    with offload.building():
        layers.append(torch.nn.Linear(4, 4))
        layers.append(torch.nn.Linear(4, 4))  # past the budget of 1 byte: stays
    offload.attach()
    assert len(offload.modules) == 1
    host = layers[0].weight.data
    x = torch.randn(2, 4)
    expected = x @ host.T + layers[0].bias.data
    seen: list[torch.Tensor] = []
    layers[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.data))  # after ours
    torch.testing.assert_close(layers[0](x), expected)
    assert seen[0].data_ptr() != host.data_ptr()  # ran on the fetched copy
    assert layers[0].weight.data.data_ptr() == host.data_ptr()  # and let go of it


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        LLM(str(MODEL), cpu_offload_gb=-1)
    with pytest.raises(ValueError, match="cpu_offload_gb=1000000.*available memory"):
        LLM(str(MODEL), cpu_offload_gb=1e6)


def test_quantized_model_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="cpu_offload_gb with quantization='fp8'"):
        LLM(str(MODEL), cpu_offload_gb=0.001, quantization="fp8")


def test_steps_without_images_prefetch_the_language_models_first_layer(tmp_path: Path) -> None:
    """LLaVA with every layer offloaded, its CLIP layers first (built first): a step without
    an image runs only the language model's layers, so its last layer must prefetch its
    first for the next step, not CLIP's first (which would stay on the device while the
    language model's first layer is fetched without overlap every step). The outputs, with
    and without images, equal the run without offload."""
    from tests.models.tiny_llava import ONE, build_tiny_llava, image

    build_tiny_llava(tmp_path)
    options: dict[str, Any] = dict(
        dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64
    )
    prompts: list[Any] = [{"prompt": ONE, "multi_modal_data": {"image": image(0)}}, "Hello"]
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **options).generate(prompts, GREEDY)]
    llm = LLM(str(tmp_path), cpu_offload_gb=1.0, **options)
    offload = offloader(llm)
    kinds = [type(module).__name__ for module in offload.modules]
    assert kinds[0] == "CLIPEncoderLayer" and kinds[-1] == "LlamaDecoderLayer"
    misses: list[str] = []  # layers whose weights were not prefetched when the forward came

    def record(index: int) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if index not in offload._pending:
                misses.append(kinds[index])

        return hook

    for index, module in enumerate(offload.modules):
        module.register_forward_pre_hook(record(index), prepend=True)  # before the fetch
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    misses.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[1:], GREEDY)] == want[1:]
    assert misses == []  # 12 steps of the language model alone
    assert all(kinds[index] == "LlamaDecoderLayer" for index in offload._pending)
