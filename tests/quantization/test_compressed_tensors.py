"""compressed-tensors checkpoints (llm-compressor's format) on the CPU reference path.

The fixtures in fixtures/ were made by llm-compressor itself (fixtures/make_ct_fixtures.py):
W8A8-FP8 dynamic (fp8 weights, per-channel scales, per-token dynamic activations), W4A16
symmetric and asymmetric with groups of 32. Next to each: `reference.safetensors` (layer 0's
weights as transformers + compressed-tensors decompress them) and `greedy.json` (greedy
tokens of transformers running that checkpoint through compressed-tensors)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.layers.quantization.compressed_tensors import CompressedTensorsWNA16Method
from pagedserve.layers.quantization.packed import pack_int32, unpack_int32
from pagedserve.models.loader import load_model
from pagedserve.quant_config import CompressedTensorsConfig, Fp8Config, GPTQConfig

from .test_fp8 import fp8_dense, linear_weights
from .test_gptq_models import assert_refused, config_folder, engine_config

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ("ct-fp8-dynamic", "ct-w4a16-g32", "ct-w4a16-asym-g32")


def quant_config(name: str) -> dict:
    config: dict = json.loads((FIXTURES / name / "config.json").read_text())
    return config["quantization_config"]


def wna16_dense(module: torch.nn.Module) -> torch.Tensor | None:
    method = getattr(module, "quant_method", None)
    if not isinstance(method, CompressedTensorsWNA16Method):
        return None
    return method.gptq.dequantize(module).t()


def load(path: Path) -> torch.nn.Module:
    hf_config = transformers.AutoConfig.from_pretrained(path)
    return load_model(
        str(path), hf_config, torch.float32, torch.device("cpu"), "auto", "compressed-tensors"
    )


def llm_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(
        str(path),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        block_size=4,
        num_gpu_blocks_override=32,
        max_model_len=64,
    ) as llm:
        assert llm.llm_engine.config.model_config.quantization == "compressed-tensors"
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_the_fixtures_parse_into_their_schemes() -> None:
    fp8 = CompressedTensorsConfig.from_config(quant_config("ct-fp8-dynamic"))
    assert fp8.scheme == Fp8Config(activation_scheme="dynamic", per_token=True)
    w4 = CompressedTensorsConfig.from_config(quant_config("ct-w4a16-g32"))
    assert w4.scheme == GPTQConfig(4, 32, desc_act=False, sym=True, zero_offset=0)
    asym = CompressedTensorsConfig.from_config(quant_config("ct-w4a16-asym-g32"))
    assert asym.scheme == GPTQConfig(4, 32, desc_act=False, sym=False, zero_offset=0)


@pytest.mark.parametrize("name", NAMES)
def test_our_unpacking_equals_the_library_decompression(name: str) -> None:
    """Every layer-0 Linear weight we serve equals what compressed-tensors decompresses."""
    model = load(FIXTURES / name)
    dense_of = fp8_dense if "fp8" in name else wna16_dense
    got = linear_weights(model, dense_of)
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    assert reference.keys() <= got.keys() and len(reference) == 7
    for key, weight in reference.items():
        assert torch.equal(got[key], weight), key


@pytest.mark.parametrize("name", NAMES)
def test_llm_greedy_equals_transformers_with_compressed_tensors(name: str) -> None:
    """Greedy tokens equal transformers + compressed-tensors running the same checkpoint
    (recorded in greedy.json when the fixture was made)."""
    expected = json.loads((FIXTURES / name / "greedy.json").read_text())
    prompts = [case["prompt"] for case in expected]
    got = llm_greedy(FIXTURES / name, prompts, len(expected[0]["output"]))
    assert got == [case["output"] for case in expected]


def test_act_order_groups_are_served(tmp_path: Path) -> None:
    """actorder "group": `weight_g_idx` maps input rows to groups. The W4A16 fixture with
    its groups stored in a shuffled order (scales' columns permuted, g_idx pointing at
    them) is the same weight, so the library's reference still holds."""
    folder = tmp_path / "actorder"
    shutil.copytree(FIXTURES / "ct-w4a16-g32", folder)
    config = json.loads((folder / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights["actorder"] = "group"
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    perms: dict[int, torch.Tensor] = {}  # one per group count: fused shards share g_idx
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        scale = tensors[name]
        groups = scale.size(1)
        perm = perms.setdefault(groups, torch.randperm(groups, generator=generator))
        shuffled = torch.empty_like(scale)
        shuffled[:, perm] = scale  # group g is stored at column perm[g]
        tensors[name] = shuffled
        g_idx = perm[torch.arange(groups * 32) // 32].to(torch.int32)
        tensors[name.removesuffix("weight_scale") + "weight_g_idx"] = g_idx
    assert any(not torch.equal(p, torch.arange(len(p))) for p in perms.values())
    save_file(tensors, str(folder / "model.safetensors"))
    got = linear_weights(load(folder), wna16_dense)
    reference = load_file(str(folder / "reference.safetensors"))
    for key, weight in reference.items():
        assert torch.equal(got[key], weight), key


def test_pack_int32_inverts_unpack() -> None:
    values = torch.randint(0, 16, (6, 16), generator=torch.Generator().manual_seed(0))
    for dim in (0, 1):
        packed = pack_int32(values if dim == 1 else values.t(), 4, dim)
        assert torch.equal(unpack_int32(packed, 4, dim), values if dim == 1 else values.t())


def test_tensor_parallel_compressed_tensors_matches_single_rank() -> None:
    """TP=2 on the asymmetric W4A16 fixture equals TP=1: q/k/v and gate/up split N (the
    zero points, packed along N, by 8), o/down split K and their groups."""
    from tests.distributed._helpers import assert_same_outputs, greedy_outputs

    path = FIXTURES / "ct-w4a16-asym-g32"
    expected = greedy_outputs(path)
    assert_same_outputs(greedy_outputs(path, tensor_parallel_size=2), expected)


def scheme(weights: dict | None, acts: dict | None = None, fmt: str = "pack-quantized") -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
        "ignore": ["lm_head"],
    }


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
INT8_ACTS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}


def test_targets_that_cover_every_linear_are_accepted(tmp_path: Path) -> None:
    groups = {"a": {"targets": ["re:.*mlp.*", "re:.*self_attn.*"], "weights": INT4}}
    config = engine_config(config_folder(tmp_path, {**scheme(INT4), "config_groups": groups}))
    assert config.model_config.quantization == "compressed-tensors"
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    groups = {"a": {"targets": names, "weights": INT4}}
    config = engine_config(config_folder(tmp_path, {**scheme(INT4), "config_groups": groups}))
    assert config.model_config.quantization == "compressed-tensors"


@pytest.mark.parametrize(
    ("quant", "error", "words"),
    [
        (
            scheme(INT8, INT8_ACTS, "int-quantized"),
            NotImplementedError,
            ["int 8-bit", "int-quantized"],
        ),
        (
            {**scheme(INT4), "sparsity_config": {"format": "sparse-24-bitmask"}},
            NotImplementedError,
            ["sparse-24-bitmask"],
        ),
        (scheme({**INT4, "group_size": 16}), ValueError, ["group_size 16", "(32, 64, 128)"]),
        (scheme({**INT4, "num_bits": 3}), ValueError, ["num_bits=3", "(4, 8)"]),
        (scheme(INT4, fmt="naive-quantized"), NotImplementedError, ["'naive-quantized'"]),
        (
            {**scheme(INT4), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]},
            NotImplementedError,
            ["down_proj"],
        ),
        (
            {**scheme(INT4), "kv_cache_scheme": {"num_bits": 8}},
            NotImplementedError,
            ["kv_cache_scheme"],
        ),
        (
            {
                **scheme(INT4),
                "config_groups": {
                    "a": {"targets": ["re:.*mlp.*"], "weights": INT4},
                    "b": {"targets": ["re:.*attn.*"], "weights": INT8},
                },
            },
            NotImplementedError,
            ["2 different schemes"],
        ),
        # Only down_proj quantized: the other linears' float weights were misread (fp8) or
        # refused as "matches no model parameter", blaming the architecture.
        (
            {
                **scheme(INT4),
                "config_groups": {"a": {"targets": ["re:.*down_proj"], "weights": INT4}},
            },
            NotImplementedError,
            ["targets ['re:.*down_proj'] leave model.layers.0.self_attn.q_proj"],
        ),
        (
            {**scheme(INT4), "config_groups": {"a": {"targets": ["re:.*mlp.*"], "weights": INT4}}},
            NotImplementedError,
            ["self_attn.q_proj", "unquantized"],
        ),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_refused(
    tmp_path: Path, quant: dict, error: type, words: list[str]
) -> None:
    assert_refused(tmp_path, quant, None, error, words)


def test_fp8_kv_cache_scheme_loads_its_scales(tmp_path: Path) -> None:
    """An FP8 `kv_cache_scheme` (llm-compressor's calibrated KV scales, written as
    `k_proj.output_scale` / `v_proj.output_scale`) loads, and the scales reach the attention
    layers that an fp8 KV cache uses; it was refused before."""
    from pagedserve.layers.attention import Attention

    folder = tmp_path / "ct-kv"
    shutil.copytree(FIXTURES / "ct-fp8-dynamic", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    num_layers = config["num_hidden_layers"]
    for i in range(num_layers):
        prefix = f"model.layers.{i}.self_attn"
        weights[f"{prefix}.k_proj.output_scale"] = torch.tensor([0.5 + i])
        weights[f"{prefix}.v_proj.output_scale"] = torch.tensor([0.25 + i])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    model = load_model(
        str(folder), hf_config, torch.float32, torch.device("cpu"), "auto", "compressed-tensors"
    )
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [(a.k_scale.item(), a.v_scale.item()) for a in layers] == [
        (0.5 + i, 0.25 + i) for i in range(num_layers)
    ]


def test_channel_strategy_splits_over_row_parallel_ranks() -> None:
    """The channel strategy (group_size -1: one group over K) keeps its group whole on each
    row-parallel rank, as GPTQ's; compressed-tensors refused it under tensor parallelism
    ("input size 32 is not a multiple of group_size 64")."""
    method = CompressedTensorsWNA16Method(
        GPTQConfig(weight_bits=4, group_size=-1, desc_act=False, zero_offset=0)
    )
    layer = torch.nn.Module()
    method.create_weights(layer, 32, [16], 64, 16, torch.float32, None)  # half of K = 64
    assert tuple(layer.weight_scale.shape) == (16, 1)
