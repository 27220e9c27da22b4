"""The API server process's EngineConfig, loaded as the engine core's is where that is safe
(issue 20: the two processes build their configs at the same time at start-up)."""

import json
import os

from pagedserve.config import EngineConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_proc import without_unused_imports
from pagedserve.engine.hub import is_local


def server_config(engine_args: EngineArgs) -> EngineConfig:
    """The API server's EngineConfig. A local text-only model's loads as the engine core's
    (`core_proc.without_unused_imports`: without torchvision and sklearn, 4.2 s and 1.2 s of
    loading a Llama config on the H200 host), since this process's config and tokenizer take
    about as long as the engine core's start (it waited 0.4 s for the core: BENCHMARKS.md,
    issue 20). It uses transformers' image processing only for the multimodal architectures,
    and never its `generate`."""
    if not (is_local(engine_args.model, engine_args.tokenizer) and _text_only(engine_args)):
        return engine_args.create_engine_config()
    return without_unused_imports(engine_args.create_engine_config)


def _text_only(engine_args: EngineArgs) -> bool:
    """Whether the local model folder's config.json (with hf_overrides) lists its
    architectures, none of them multimodal (`registry.MULTIMODAL_ARCHITECTURES`, as
    `build_processors`); False where it cannot tell (the config's loading then says why)."""
    try:
        with open(os.path.join(engine_args.model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    overrides = engine_args.hf_overrides
    if isinstance(overrides, dict) and "architectures" in overrides:
        config = overrides
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        return False
    # Imported here: importing the API server loads no pagedserve.models module.
    from pagedserve.models.registry import MULTIMODAL_ARCHITECTURES

    return not any(a in MULTIMODAL_ARCHITECTURES for a in architectures)
