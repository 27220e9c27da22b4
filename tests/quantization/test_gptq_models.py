"""GPTQ checkpoints end to end on the CPU: which method is used (the option, else
config.json's quantization_config), the errors for unsupported or contradicting ones, and
greedy output of `LLM` on a packed checkpoint equal to transformers running the same
quantized grid as float weights."""

import argparse
import json
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs, engine_args_from_namespace
from pagedserve.entrypoints.openai.cli_args import add_engine_args
from pagedserve.models.loader import load_model
from tests.entrypoints.test_llm_greedy import hf_greedy

from .gptq_pack import quantization_config, write_gptq_checkpoint

CONFIG = transformers.LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # peaked logits: no near-ties for float rounding to flip
    tie_word_embeddings=False,
    architectures=["LlamaForCausalLM"],
)


def config_folder(path: Path, quant: dict | None, config: transformers.PretrainedConfig = CONFIG):
    """A folder with only config.json (enough to build the engine's config)."""
    path.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    if quant is not None:
        data["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(data))
    return path


def engine_config(path: Path, **options: object):  # type: ignore[no-untyped-def]
    return EngineArgs(model=str(path), device="cpu", **options).create_engine_config()


def test_quant_method_is_read_from_the_checkpoint(tmp_path: Path) -> None:
    folder = config_folder(tmp_path / "m", quantization_config(4, 128, True, False))
    assert engine_config(folder).model_config.quantization == "gptq"
    assert engine_config(folder, quantization="gptq").model_config.quantization == "gptq"
    plain = config_folder(tmp_path / "plain", None)
    assert engine_config(plain).model_config.quantization is None


def test_the_cli_flag_reaches_the_engine_args(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["--quantization", "gptq"]))
    assert args.quantization == "gptq"
    assert engine_args_from_namespace(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


@pytest.mark.parametrize(
    ("quant", "option", "error", "words"),
    [
        # a flag contradicting the checkpoint names both
        (quantization_config(4, 128, False, True), "awq", ValueError, ["'awq'", "'gptq'"]),
        # unsupported bits / group size / method name the value and the supported ones
        (
            {**quantization_config(4, 128, False, True), "bits": 3},
            None,
            ValueError,
            ["bits=3", "(4, 8)"],
        ),
        (
            {**quantization_config(4, 128, False, True), "group_size": 16},
            None,
            ValueError,
            ["group_size=16", "(-1, 32, 64, 128)"],
        ),
        ({"quant_method": "bitsandbytes"}, None, ValueError, ["'bitsandbytes'", "gptq"]),
        (None, "int3", ValueError, ["'int3'", "gptq"]),
        (
            {**quantization_config(4, 128, False, True), "checkpoint_format": "marlin"},
            None,
            ValueError,
            ["'marlin'", "gptq_v2"],
        ),
        # a method named for an unquantized checkpoint
        (None, "gptq", ValueError, ["no quantization_config"]),
        # a compressed-tensors config without schemes is never loaded as if unquantized
        ({"quant_method": "compressed-tensors"}, None, ValueError, ["no config_groups"]),
        # a malformed one is a ValueError naming the field (it was an AttributeError)
        (
            {"quant_method": "compressed-tensors", "config_groups": [{"targets": ["Linear"]}]},
            None,
            ValueError,
            ["config_groups must map", "list"],
        ),
    ],
)
def test_unsupported_or_contradicting_quantization_is_refused(
    tmp_path: Path, quant: dict | None, option: str | None, error: type, words: list[str]
) -> None:
    assert_refused(tmp_path, quant, option, error, words)


def assert_refused(
    tmp_path: Path, quant: dict | None, option: str | None, error: type, words: list[str]
) -> None:
    """Building the engine config of a checkpoint with quantization_config `quant` and
    `quantization=option` raises `error` with each of `words` in its message."""
    folder = config_folder(tmp_path / "m", quant)
    with pytest.raises(error) as info:
        engine_config(folder, quantization=option)
    for word in words:
        assert word in str(info.value)


def test_a_quantized_gpt2_is_refused_not_misloaded(tmp_path: Path) -> None:
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.quantization_config = quantization_config(4, 32, False, True)
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel.*quantized"):
        load_model(str(tmp_path), config, torch.float32, torch.device("cpu"), "dummy", "gptq")


@pytest.fixture(scope="module")
def float_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("float")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32).save_pretrained(path)
    return path


PROMPTS = [[5, 17, 300, 42], [7] * 20, list(range(100, 133)), [450, 3]]


def llm_greedy(
    path: Path, option: str | None, method: str, prompts: list[list[int]] = PROMPTS
) -> list[list[int]]:
    """Greedy 10-token outputs of `LLM` on `prompts` from the quantized checkpoint `path`
    (`quantization=option`), checking that the engine resolved `method`."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(
        str(path),
        quantization=option,
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        block_size=4,
        num_gpu_blocks_override=32,
        max_model_len=64,
    ) as llm:
        assert llm.llm_engine.config.model_config.quantization == method
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize(
    ("bits", "group_size", "desc_act", "sym", "option"),
    [(4, 32, True, False, None), (8, 128, False, True, "gptq"), (4, -1, False, True, None)],
)
def test_llm_greedy_on_gptq_equals_transformers_on_the_dequantized_model(
    float_model: Path,
    tmp_path: Path,
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    option: str | None,
) -> None:
    gptq, dequantized = tmp_path / "gptq", tmp_path / "dequantized"
    write_gptq_checkpoint(float_model, gptq, dequantized, bits, group_size, desc_act, sym)
    expected = hf_greedy(dequantized, PROMPTS, 10)
    assert expected != hf_greedy(float_model, PROMPTS, 10) or bits == 8  # 4-bit changes tokens
    assert llm_greedy(gptq, option, "gptq") == expected


@pytest.mark.parametrize("desc_act", [True, False])
def test_tensor_parallel_gptq_matches_single_rank(tmp_path: Path, desc_act: bool) -> None:
    """TP=2 (worker processes) on a GPTQ checkpoint gives TP=1's greedy tokens and logprobs:
    q/k/v and gate/up split N (qzeros by pack), o/down split K (act-order: all groups on each
    rank; else each rank its groups)."""
    from tests.distributed._helpers import assert_same_outputs, greedy_outputs, save_tiny_model

    float_path = save_tiny_model("llama_gqa", tmp_path / "float")
    gptq = tmp_path / "gptq"
    write_gptq_checkpoint(float_path, gptq, tmp_path / "dequantized", 4, 32, desc_act, False)
    expected = greedy_outputs(gptq)
    assert_same_outputs(greedy_outputs(gptq, tensor_parallel_size=2), expected)
