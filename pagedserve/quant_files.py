"""Quantization parameters that older checkpoints keep in a file beside config.json instead
of config.json's quantization_config (AutoGPTQ's quantize_config.json, AutoAWQ's
quant_config.json): read them and attach them to the loaded HF config, so that
`pagedserve.quant_config` (and the workers, which receive that config) see them as
config.json's.

Import rule: a torch-free leaf (imports nothing from pagedserve).
"""

import json
import os
from typing import Any

# Files beside config.json in which older tools wrote their parameters, with no
# quantization_config in config.json: AutoGPTQ's quantize_config.json and AutoAWQ's
# quant_config.json (some AWQ uploads name theirs quantize_config.json). vLLM's
# `get_quant_config` reads the same names (GPTQ: quantize_config.json; AWQ: either) when
# config.json has no quantization_config.
QUANT_CONFIG_FILES = ("quantize_config.json", "quant_config.json")
# Keys only AutoAWQ's files have (AutoGPTQ's say bits / group_size / desc_act).
_AWQ_KEYS = ("w_bit", "q_group_size", "zero_point", "version")
# Where config.json holds the parameters (`quant_config.checkpoint_quant_config` reads them).
CONFIG_JSON_KEYS = ("quantization_config", "compression_config")
# Attribute of the loaded HF config naming the file its quantization_config came from.
QUANT_CONFIG_FILE_ATTR = "pagedserve_quant_config_file"


def read_quant_config_file(model_dir: str) -> tuple[str, dict[str, Any]] | None:
    """(file name, parameters) of the quantization file beside config.json in `model_dir`
    (QUANT_CONFIG_FILES), or None if there is none.

    A file without `quant_method` (AutoAWQ's, older AutoGPTQ's) gets the one its keys
    show: "awq" for AutoAWQ's keys (w_bit, q_group_size, zero_point, version), else "gptq"
    for AutoGPTQ's (bits with group_size or desc_act); none if neither (the caller then
    needs the `quantization` option). Raises ValueError when both files are present (as
    vLLM, which refuses several candidate files) or a file is not a JSON object."""
    found = [name for name in QUANT_CONFIG_FILES if os.path.isfile(os.path.join(model_dir, name))]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"the model folder {model_dir!r} has both {' and '.join(found)} and config.json "
            f"has no quantization_config: cannot tell which one holds the checkpoint's "
            f"quantization parameters; remove the other"
        )
    name = found[0]
    with open(os.path.join(model_dir, name), encoding="utf-8") as f:
        try:
            params = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} in {model_dir!r} is not valid JSON: {e}") from e
    if not isinstance(params, dict):
        raise ValueError(f"{name} in {model_dir!r} must hold a JSON object, got {params!r}")
    if "quant_method" not in params:
        if any(key in params for key in _AWQ_KEYS):
            params["quant_method"] = "awq"
        elif "bits" in params and ("group_size" in params or "desc_act" in params):
            params["quant_method"] = "gptq"
    return name, params


def attach_quant_config_file(hf_config: Any, model_dir: str) -> None:
    """Give a loaded HF config without a quantization_config the parameters of the
    quantization file beside config.json (`read_quant_config_file`), as its
    `quantization_config`, so that `resolve_quantization`, `get_quantization_config` and the
    workers (which receive this config) read them as config.json's; the file's name goes in
    the attribute QUANT_CONFIG_FILE_ATTR for messages. No-op when config.json has a
    quantization_config (vLLM reads the files only then) or there is no file."""
    if any(getattr(hf_config, name, None) is not None for name in CONFIG_JSON_KEYS):
        return
    found = read_quant_config_file(model_dir)
    if found is not None:
        name, params = found
        hf_config.quantization_config = params
        setattr(hf_config, QUANT_CONFIG_FILE_ATTR, name)


def quant_config_source(hf_config: Any) -> str:
    """Where the checkpoint's quantization parameters came from, for messages."""
    name = getattr(hf_config, QUANT_CONFIG_FILE_ATTR, None)
    return str(name) if name else "config.json's quantization_config"
