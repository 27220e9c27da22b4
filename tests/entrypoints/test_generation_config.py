"""generation_config.json as the defaults of requests that leave sampling fields out, as vLLM's
`--generation-config auto|vllm|FOLDER`, offline (`LLM.generate`/`chat` without
sampling_params, `LLM.get_default_sampling_params()`); the server's side is in
tests/entrypoints/openai/test_generation_defaults.py."""

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.llm import LLM
from pagedserve.errors import UnsupportedModelError
from pagedserve.sampling_params import SamplingParams, is_default_max_tokens

SMALL = {"device": "cpu", "max_model_len": 64, "kv_cache_memory_bytes": 4 << 20}
PROMPT = "Once upon a time"
MODEL_DEFAULTS = {
    "temperature": 0.0,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def model_with(folder: Path, generation_config: dict[str, Any]) -> str:
    """A copy of the bundled model whose generation_config.json is `generation_config`."""
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return str(folder)


def test_model_generation_config_sets_the_defaults_offline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = model_with(tmp_path / "m", {**MODEL_DEFAULTS, "do_sample": True, "eos_token_id": 2})
    with caplog.at_level(logging.INFO), LLM(model, **SMALL) as llm:
        defaults = llm.get_default_sampling_params()
        explicit = SamplingParams(
            temperature=0.0, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1, max_tokens=7
        )
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 0.9, 5)
        assert (defaults.min_p, defaults.repetition_penalty) == (0.05, 1.1)
        assert defaults.max_tokens == 7 and is_default_max_tokens(defaults.max_tokens)
        [out] = llm.generate(PROMPT, use_tqdm=False)
        [same] = llm.generate(PROMPT, explicit, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 7  # not vLLM's neutral 16 tokens at T=1
        assert out.outputs[0].token_ids == same.outputs[0].token_ids
        [chat] = llm.chat([{"role": "user", "content": PROMPT}], None, False, TEMPLATE)
        assert len(chat.outputs[0].token_ids) == 7
        # The request's own SamplingParams win over every default.
        [own] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(own.outputs[0].token_ids) == 3
    logged = [r.getMessage() for r in caplog.records if "default sampling parameters" in r.message]
    assert len(logged) == 1 and "'max_tokens': 7" in logged[0] and "'temperature': 0.0" in logged[0]


def test_vllm_mode_keeps_neutral_defaults(tmp_path: Path) -> None:
    model = model_with(tmp_path / "m", MODEL_DEFAULTS)
    config = EngineArgs(model=model, generation_config="vllm", **SMALL).create_engine_config()
    assert config.model_config.get_diff_sampling_param() == {}
    config = EngineArgs(model=model, **SMALL).create_engine_config()
    expected = {k: v for k, v in MODEL_DEFAULTS.items() if k != "max_new_tokens"}
    assert config.model_config.get_diff_sampling_param() == {**expected, "max_tokens": 7}


def test_a_generation_config_folder_gives_defaults_and_eos_ids(tmp_path: Path) -> None:
    with LLM(DEFAULT_MODEL, **SMALL) as llm:
        greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    tokens = list(greedy[0].outputs[0].token_ids)
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0, "max_new_tokens": 12, "eos_token_id": [2, tokens[stop_at]]})
    )
    with LLM(DEFAULT_MODEL, generation_config=str(folder), **SMALL) as llm:
        assert tokens[stop_at] in llm.llm_engine.input_processor.eos_token_ids
        [out] = llm.generate(PROMPT, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"  # every EOS id listed stops generation
    assert list(completion.token_ids)[:stop_at] == tokens[:stop_at]
    assert len(completion.token_ids) <= stop_at + 1


def test_max_new_tokens_beyond_the_context_is_lowered(tmp_path: Path) -> None:
    model = model_with(tmp_path / "m", {"temperature": 0, "max_new_tokens": 100000})
    with LLM(model, **{**SMALL, "max_model_len": 24}) as llm:
        [out] = llm.generate(PROMPT, use_tqdm=False)
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24


def test_unusable_generation_configs_fail_at_start(tmp_path: Path) -> None:
    model = model_with(tmp_path / "m", {"top_p": 0.0})
    with pytest.raises(UnsupportedModelError, match="generation_config.json.*top_p"):
        EngineArgs(model=model, **SMALL).create_engine_config()
    EngineArgs(model=model, generation_config="vllm", **SMALL).create_engine_config()
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        EngineArgs(generation_config=str(tmp_path / "nope"), **SMALL).create_engine_config()
