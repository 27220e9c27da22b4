"""The real server on a GPTQ checkpoint made by GPTQModel (the 4-bit act-order fixture of
tests/quantization/fixtures, with the stories260k tokenizer it was made with and a chat
template): the method is auto-detected from config.json, completions and chat (stream and
not) give the offline `LLM`'s greedy tokens, and a `--quantization` contradicting the
checkpoint stops the server at start-up with a message naming both."""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import DEFAULT_MODEL

from .conftest import REPO, STARTUP_TIMEOUT_S, Server

FIXTURE = REPO / "tests" / "quantization" / "fixtures" / "gptqmodel-4bit-g32-actorder-asym"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
MAX_TOKENS = 12
MAX_MODEL_LEN = 256  # the fixture's context


def gptq_folder(path: Path) -> Path:
    """The GPTQModel fixture with the stories260k tokenizer (whose vocabulary it was made
    with) and TEMPLATE as its chat template."""
    shutil.copytree(FIXTURE, path)
    for name in ("tokenizer.json", "tokenizer.model", "special_tokens_map.json"):
        shutil.copy(Path(DEFAULT_MODEL) / name, path / name)
    config = json.loads((Path(DEFAULT_MODEL) / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gptq_folder(tmp_path_factory.mktemp("gptq") / "model")


@pytest.fixture(scope="module")
def offline(model: Path) -> dict[str, Any]:
    """The offline LLM's greedy outputs: token strings (as the server's logprobs name them)
    and texts, for PROMPT and MESSAGES."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(model), device="cpu", max_model_len=MAX_MODEL_LEN) as llm:
        assert llm.llm_engine.config.model_config.quantization == "gptq"
        [completion] = llm.generate(PROMPT, params, use_tqdm=False)
        [chat] = llm.chat(MESSAGES, params, use_tqdm=False)

    def tokens(output: Any) -> list[str]:
        sample = output.outputs[0]
        pairs = zip(sample.token_ids, sample.logprobs, strict=True)
        return [logprobs[token].decoded_token for token, logprobs in pairs]

    return {
        "completion": (completion.outputs[0].text, tokens(completion)),
        "chat": (chat.outputs[0].text, tokens(chat)),
    }


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("gptq-server") / "server.log"
    running = Server(model, log, None, ["--max-model-len", str(MAX_MODEL_LEN)])
    try:
        yield running
    finally:
        running.stop()


def test_completions_give_the_offline_greedy_tokens(server: Server, offline: dict) -> None:
    text, tokens = offline["completion"]
    client = server.client()
    extra = {"ignore_eos": True}
    response = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
        extra_body=extra,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens == tokens
    assert choice.text == text
    stream = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        extra_body=extra,
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text


def test_chat_gives_the_offline_greedy_tokens(server: Server, offline: dict) -> None:
    text, tokens = offline["chat"]
    client = server.client()
    extra = {"ignore_eos": True}
    response = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        logprobs=True, extra_body=extra,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [entry.token for entry in choice.logprobs.content] == tokens
    assert choice.message.content == text
    stream = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        stream=True, extra_body=extra,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


def test_a_contradicting_quantization_flag_stops_the_server_at_start(model: Path) -> None:
    command = [
        sys.executable, "-m", "pagedserve.entrypoints.openai.api_server", "--model", str(model),
        "--device", "cpu", "--port", "0", "--quantization", "awq",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert done.returncode != 0
    output = done.stdout + done.stderr
    # one clear line (the CLI's error), not a traceback from deep in the engine
    assert "error: quantization='awq'" in output and "'gptq'" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
