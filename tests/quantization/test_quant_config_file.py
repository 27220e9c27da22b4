"""Older checkpoints keep their quantization parameters in a file beside config.json
(AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json) and have no
quantization_config in config.json: the engine reads the file (as vLLM's `get_quant_config`),
detects the method from it, and checks a `quantization` option against it."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.quant_config import AWQConfig, GPTQConfig, get_quantization_config
from tests.entrypoints.test_llm_greedy import hf_greedy

from .gptq_pack import quantization_config, write_gptq_checkpoint
from .test_gptq_models import CONFIG, PROMPTS, config_folder, engine_config, llm_greedy

# What AutoGPTQ 0.4-0.6 wrote: no quant_method, no checkpoint_format.
AUTOGPTQ_FILE = {
    "bits": 4,
    "group_size": 32,
    "damp_percent": 0.01,
    "desc_act": True,
    "static_groups": False,
    "sym": False,
    "true_sequential": True,
    "model_name_or_path": None,
    "model_file_base_name": "model",
}
# What AutoAWQ writes (quant_config.json).
AUTOAWQ_FILE = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}


def folder_with_file(path: Path, name: str, params: dict) -> Path:
    """A config-only folder whose config.json has no quantization_config, with `params` in
    the file `name` beside it."""
    folder = config_folder(path, None)
    (folder / name).write_text(json.dumps(params))
    return folder


def test_gptq_is_detected_from_quantize_config_json(tmp_path: Path) -> None:
    config = engine_config(folder_with_file(tmp_path, "quantize_config.json", AUTOGPTQ_FILE))
    model_config = config.model_config
    assert model_config.quantization == "gptq"
    parsed = get_quantization_config("gptq", model_config.hf_config)
    assert parsed == GPTQConfig(weight_bits=4, group_size=32, desc_act=True, sym=False)


@pytest.mark.parametrize("name", ["quant_config.json", "quantize_config.json"])
def test_awq_is_detected_from_its_file(tmp_path: Path, name: str) -> None:
    model_config = engine_config(folder_with_file(tmp_path, name, AUTOAWQ_FILE)).model_config
    assert model_config.quantization == "awq"
    assert get_quantization_config("awq", model_config.hf_config) == AWQConfig(
        weight_bits=4, group_size=64
    )


def test_the_option_alone_names_the_method_of_a_file_that_does_not(tmp_path: Path) -> None:
    params = {"bits": 8, "sym": True}  # no quant_method, nor keys that tell the tool
    folder = folder_with_file(tmp_path, "quantize_config.json", params)
    assert engine_config(folder, quantization="gptq").model_config.quantization == "gptq"
    with pytest.raises(ValueError, match=r"quantize_config\.json.*no quant_method"):
        engine_config(folder)


def test_an_option_contradicting_the_file_names_both(tmp_path: Path) -> None:
    folder = folder_with_file(tmp_path, "quantize_config.json", AUTOGPTQ_FILE)
    with pytest.raises(ValueError) as info:
        engine_config(folder, quantization="awq")
    for word in ("'awq'", "'gptq'", "quantize_config.json"):
        assert word in str(info.value)


def test_unsupported_parameters_in_the_file_are_refused(tmp_path: Path) -> None:
    folder = folder_with_file(tmp_path, "quantize_config.json", {**AUTOGPTQ_FILE, "bits": 3})
    with pytest.raises(ValueError, match=r"bits=3.*\(4, 8\)"):
        engine_config(folder)


def test_both_files_are_ambiguous(tmp_path: Path) -> None:
    folder = folder_with_file(tmp_path, "quantize_config.json", AUTOGPTQ_FILE)
    (folder / "quant_config.json").write_text(json.dumps(AUTOAWQ_FILE))
    with pytest.raises(ValueError, match="both quantize_config.json and quant_config.json"):
        engine_config(folder)


def test_config_json_wins_over_the_file(tmp_path: Path) -> None:
    """As vLLM: the file is read only when config.json has no quantization_config."""
    folder = config_folder(tmp_path, quantization_config(8, 128, False, True))
    (folder / "quant_config.json").write_text(json.dumps(AUTOAWQ_FILE))
    model_config = engine_config(folder).model_config
    assert model_config.quantization == "gptq"
    assert get_quantization_config("gptq", model_config.hf_config).weight_bits == 8


def test_no_file_and_no_config_names_the_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no quantization_config.*quantize_config\.json"):
        engine_config(config_folder(tmp_path, None), quantization="gptq")


def test_llm_loads_a_checkpoint_whose_parameters_are_in_quantize_config_json(
    tmp_path: Path,
) -> None:
    """The whole path (engine config, workers, loader) reads the file: greedy output equals
    transformers on the dequantized model (on the starting commit: "g_idx matches no model
    parameter")."""
    float_model, gptq = tmp_path / "float", tmp_path / "gptq"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIG).save_pretrained(float_model)
    write_gptq_checkpoint(float_model, gptq, tmp_path / "dequantized", 4, 32, True, False)
    expected = hf_greedy(tmp_path / "dequantized", PROMPTS, 10)
    config = json.loads((gptq / "config.json").read_text())
    params = config.pop("quantization_config")
    del params["quant_method"], params["checkpoint_format"]  # as AutoGPTQ 0.4-0.6 wrote it
    (gptq / "config.json").write_text(json.dumps(config))
    (gptq / "quantize_config.json").write_text(json.dumps(params))
    assert llm_greedy(gptq, None, "gptq") == expected
