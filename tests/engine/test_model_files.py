"""--trust-remote-code (a model folder with its own config and tokenizer code) and
--hf-overrides (JSON merged into config.json)."""

import json
import shutil
from pathlib import Path

import pytest

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.llm import LLM
from pagedserve.errors import UnsupportedModelError
from pagedserve.sampling_params import SamplingParams

SMALL = {"device": "cpu", "max_model_len": 64, "kv_cache_memory_bytes": 4 << 20}
CONFIG_CODE = """from transformers import LlamaConfig


class StoryConfig(LlamaConfig):
    model_type = "story_llama"
"""
TOKENIZER_CODE = """from transformers import LlamaTokenizerFast


class StoryTokenizer(LlamaTokenizerFast):
    pass
"""


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def custom_code_model(folder: Path, config_code: bool, tokenizer_code: bool) -> str:
    """The bundled model with its own config class and/or tokenizer class (auto_map)."""
    shutil.copytree(DEFAULT_MODEL, folder)
    if config_code:
        (folder / "configuration_story.py").write_text(CONFIG_CODE)
        auto_map = {"AutoConfig": "configuration_story.StoryConfig"}
        edit_json(folder / "config.json", model_type="story_llama", auto_map=auto_map)
    if tokenizer_code:
        (folder / "tokenization_story.py").write_text(TOKENIZER_CODE)
        auto_map_tok = {"AutoTokenizer": [None, "tokenization_story.StoryTokenizer"]}
        edit_json(
            folder / "tokenizer_config.json",
            auto_map=auto_map_tok,
            tokenizer_class="StoryTokenizer",
        )
    return str(folder)


def test_custom_code_needs_trust_remote_code(tmp_path: Path) -> None:
    model = custom_code_model(tmp_path / "both", config_code=True, tokenizer_code=True)
    with pytest.raises(UnsupportedModelError) as info:
        EngineArgs(model=model, **SMALL).create_engine_config()
    message = str(info.value)
    assert "\n" not in message and "--trust-remote-code" in message
    assert "configuration_story.StoryConfig" in message
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(model, trust_remote_code=True, **SMALL) as llm:
        assert type(llm.llm_engine.config.model_config.hf_config).__name__ == "StoryConfig"
        assert type(llm.get_tokenizer()).__name__ == "StoryTokenizer"
        custom = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text
    with LLM(DEFAULT_MODEL, **SMALL) as llm:
        plain = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text
    assert custom == plain


def test_tokenizer_code_needs_trust_remote_code(tmp_path: Path) -> None:
    model = custom_code_model(tmp_path / "tok", config_code=False, tokenizer_code=True)
    with pytest.raises(UnsupportedModelError) as info:
        LLM(model, **SMALL)
    message = str(info.value)
    assert "\n" not in message and "--trust-remote-code" in message
    assert message.startswith("tokenizer") and "tokenization_story.StoryTokenizer" in message


def test_hf_overrides_merge_into_the_config(tmp_path: Path) -> None:
    overrides = {"max_position_embeddings": 96, "rope_theta": 5000.0, "custom_flag": True}
    config = EngineArgs(hf_overrides=overrides, device="cpu").create_engine_config()
    hf_config = config.model_config.hf_config
    assert config.model_config.max_model_len == 96  # derived after the overrides
    assert (hf_config.max_position_embeddings, hf_config.custom_flag) == (96, True)
    args = build_parser().parse_args(["serve", "--hf-overrides", json.dumps(overrides)])
    assert args.hf_overrides == overrides
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hf-overrides", "[1, 2]"])
    with pytest.raises(ValueError, match="hf_overrides must be dict or None"):
        EngineArgs(hf_overrides="max_position_embeddings=96").create_engine_config()  # type: ignore[arg-type]


def test_hf_overrides_update_a_nested_config() -> None:
    from transformers import LlamaConfig, PretrainedConfig

    from pagedserve.engine.model_files import apply_hf_overrides

    outer = PretrainedConfig()
    outer.text_config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    apply_hf_overrides(outer, {"text_config": {"hidden_size": 32}, "tie_word_embeddings": False})
    assert isinstance(outer.text_config, LlamaConfig)
    assert (outer.text_config.hidden_size, outer.text_config.num_attention_heads) == (32, 4)
    assert outer.tie_word_embeddings is False


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"vocab_size": "x"}, "hf_overrides sets vocab_size='x'"),
        ({"max_position_embeddings": None}, "hf_overrides sets max_position_embeddings=None"),
    ],
)
def test_an_override_the_config_refuses_is_one_line_naming_it(
    overrides: dict[str, object], words: str
) -> None:
    """transformers' strict-dataclass error is no ValueError: `pagedserve serve` printed a
    traceback of several lines."""
    from pagedserve.entrypoints.openai.api_server import run_server

    with pytest.raises(UnsupportedModelError, match=words):
        EngineArgs(hf_overrides=overrides, **SMALL).create_engine_config()
    flags = ["--hf-overrides", json.dumps(overrides), "--device", "cpu", "--port", "0"]
    with pytest.raises(SystemExit) as exit_info:
        run_server(build_parser().parse_args(["serve", *flags]))
    message = str(exit_info.value.code)
    assert message.startswith("pagedserve serve: error: ") and "\n" not in message
    assert words in message
