"""What the engine reads from a local model folder before any worker starts: transformers'
config (with `trust_remote_code` and `hf_overrides`), the EOS ids, and the sampling defaults
of `generation_config.json` (vLLM's `--generation-config`)."""

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from pagedserve.engine.deferred_activations import activations_deferred
from pagedserve.errors import UnsupportedModelError
from pagedserve.quant_files import attach_quant_config_file
from pagedserve.sampling_params import SamplingParams, default_max_tokens

logger = logging.getLogger(__name__)

# The generation_config.json fields that become request defaults (vLLM's
# ModelConfig.get_diff_sampling_param); max_new_tokens is transformers' name of max_tokens.
GENERATION_DEFAULT_FIELDS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def check_model_folder(model: str) -> None:
    """Raise UnsupportedModelError in one line when the local folder `model` does not exist
    or has no config.json, naming the architectures we run. Imports neither torch nor
    transformers, so that a wrong path fails at once."""
    from pagedserve.models.registry import SUPPORTED_ARCHITECTURES

    path = Path(model)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise UnsupportedModelError(
            f"model folder {model!r} {what}; pagedserve loads local Hugging Face folders "
            f"(config.json + *.safetensors), or Hub ids (ORG/NAME), of these architectures: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )


def load_hf_config(
    model: str, trust_remote_code: bool = False, hf_overrides: dict[str, Any] | None = None
) -> Any:
    """transformers' config of a local model folder, with `hf_overrides` merged in (vLLM's
    `--hf-overrides`: each key set on the config; a dict for a nested config, such as
    `text_config`, is merged into it). An older quantized checkpoint's quantize_config.json /
    quant_config.json is attached as its quantization_config where config.json has none
    (`quant_files.attach_quant_config_file`; overrides still win).

    Raises UnsupportedModelError if the folder or its config.json is missing, or when the
    config needs the folder's own code (config.json's `auto_map`) and `trust_remote_code`
    is off. Loads without the modeling imports that transformers' config modules pull in
    (torch.distributed.tensor; `deferred_activations`), seconds of the server's start.
    """
    check_model_folder(model)
    start = time.perf_counter()
    from transformers import AutoConfig

    imported = time.perf_counter()
    try:
        with activations_deferred():
            config = AutoConfig.from_pretrained(
                model, local_files_only=True, trust_remote_code=trust_remote_code
            )
    except ValueError as e:
        raise remote_code_error(e, "model", model, "config.json") from None
    # the server's start-up breakdown (issue 20): where its "engine config" seconds go
    logger.info(
        "model config (%s) in %.1f s: importing transformers %.1f s, its config classes and the "
        "file %.1f s",
        type(config).__name__,
        time.perf_counter() - start,
        imported - start,
        time.perf_counter() - imported,
    )
    attach_quant_config_file(config, model)
    if hf_overrides:
        apply_hf_overrides(config, hf_overrides)
    return config


def remote_code_error(error: ValueError, what: str, folder: str, file: str) -> ValueError:
    """transformers' refusal to run a folder's own code without trust_remote_code, as one
    line saying to pass it (UnsupportedModelError); any other ValueError as it is."""
    if "trust_remote_code" not in str(error):
        return error
    try:
        auto_map = json.loads((Path(folder) / file).read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        auto_map = None
    return UnsupportedModelError(
        f"{what} {folder!r} needs its own Python code to load ({file}'s auto_map: {auto_map}); "
        f"pass --trust-remote-code (LLM(..., trust_remote_code=True)) to run it"
    )


def apply_hf_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Set each key of `overrides` on `config` (a transformers PretrainedConfig); a dict
    given for an attribute that is itself a config updates that config, key by key. Raises
    UnsupportedModelError naming the key when transformers refuses the value (a string
    vocab_size): its own error is no ValueError, a traceback from `pagedserve serve`."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            apply_hf_overrides(current, value)
            continue
        try:
            setattr(config, key, value)
        except (StrictDataclassError, TypeError, ValueError) as e:  # transformers' field checks
            reason = " ".join(str(e).split())
            raise UnsupportedModelError(
                f"hf_overrides sets {key}={value!r}, which the model's config refuses: {reason}"
            ) from None
    logger.info("hf_overrides applied to the model's config: %s", overrides)


def generation_config_folder(model: str, generation_config: str) -> str | None:
    """The folder whose generation_config.json is read: the model's for "auto" and "vllm"
    (vLLM reads its EOS ids either way), the option's own folder otherwise."""
    return model if generation_config in ("auto", "vllm") else generation_config


def read_generation_config(folder: str | None) -> dict[str, Any]:
    """generation_config.json of `folder` as a dict ({} when there is none). Raises
    UnsupportedModelError when it is not a JSON object."""
    if folder is None:
        return {}
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_eos_token_ids(
    model: str, hf_config: Any, generation_config: dict[str, Any] | None = None
) -> tuple[int, ...]:
    """EOS ids: every one that generation_config.json lists (read from `model` unless
    given), then config.json's (either may hold a list)."""
    if generation_config is None:
        generation_config = read_generation_config(model)
    ids: list[int] = []
    sources = [
        generation_config.get("eos_token_id"),
        getattr(hf_config, "eos_token_id", None),
        getattr(getattr(hf_config, "text_config", None), "eos_token_id", None),  # multimodal
    ]
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if isinstance(token_id, int) and not isinstance(token_id, bool) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def diff_sampling_param(generation_config: dict[str, Any], mode: str) -> dict[str, Any]:
    """The sampling defaults a generation config sets (vLLM's `get_diff_sampling_param`):
    its temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
    max_tokens; {} for mode "vllm" (vLLM's neutral defaults). `do_sample` is not read, as in
    vLLM. Raises UnsupportedModelError naming the field when a value is not a valid
    sampling parameter."""
    if mode == "vllm":
        return {}
    defaults = {
        k: generation_config[k]
        for k in GENERATION_DEFAULT_FIELDS
        if generation_config.get(k) is not None
    }
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)  # a bad value fails at start, not in every request
    except ValueError as e:
        raise UnsupportedModelError(
            f"generation_config.json has a sampling default pagedserve cannot use ({e}); "
            f"pass --generation-config vllm to ignore it"
        ) from None
    return defaults


def default_sampling_params(diff: dict[str, Any]) -> SamplingParams:
    """SamplingParams with the model's defaults (vLLM's `LLM.get_default_sampling_params`);
    a max_tokens from the generation config is a default, lowered to what the context
    leaves after the prompt (as the server's left-out max_tokens)."""
    values = dict(diff)
    if "max_tokens" in values:
        values["max_tokens"] = default_max_tokens(values["max_tokens"])
    return SamplingParams(**values)


def log_diff_sampling_param(diff: dict[str, Any], source: str) -> None:
    """The one start-up line saying which defaults the generation config set (vLLM warns
    the same way), or nothing."""
    if diff:
        logger.info(
            "default sampling parameters from %s: %s (requests that set them win; "
            "--generation-config vllm ignores them)",
            source,
            diff,
        )
