"""Images in /v1/chat/completions (issue 18): a real server process on a tiny random LLaVA
(tests/models/tiny_llava.py) with the official openai client; greedy output equals the offline
LLM.generate of the same rendered prompt and images, and each bad image is a 400 naming its
content part while the server keeps serving."""

import base64
import functools
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from pagedserve import LLM
from tests.models.image_urls import data_url, png
from tests.models.tiny_llava import GREEDY, MAX_TOKENS, build_tiny_llava, image

from .conftest import Server

MAX_IMAGE_BYTES = 20_000  # PAGEDSERVE_MAX_IMAGE_BYTES of the server: a 50x40 PNG is ~6 kB
ONE_RENDERED = "USER: <image>\nWhat is in this picture? ASSISTANT:"
TWO_RENDERED = "USER: <image>\n<image>\nHow do they differ? ASSISTANT:"
CHAT_PARAMS: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS}
IGNORE_EOS = {"ignore_eos": True}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llava")
    build_tiny_llava(path)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The --allowed-local-media-path folder, and the http server's: cat.png, a too-big file."""
    path = tmp_path_factory.mktemp("media")
    (path / "cat.png").write_bytes(png(image(1)))
    (path / "big.png").write_bytes(b"\0" * (MAX_IMAGE_BYTES + 1))
    return path


class MediaHandler(http.server.SimpleHTTPRequestHandler):
    """Files, and /unsized: a body larger than the cap with no Content-Length (HTTP/1.0, read
    until the connection closes), which the fetch must stop reading at the cap."""

    def do_GET(self) -> None:
        if self.path != "/unsized":
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(b"\0" * (2 * MAX_IMAGE_BYTES))

    def log_message(self, *args: Any) -> None:  # keep the test output clean
        pass


@pytest.fixture(scope="module")
def http_url(media_dir: Path) -> Iterator[str]:
    """A static file server on loopback (serving `media_dir`)."""
    handler = functools.partial(MediaHandler, directory=str(media_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(
    llava_dir: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    args = [
        "--dtype", "float32", "--max-model-len", "256", "--limit-mm-per-prompt",
        '{"image": 2}', "--allowed-local-media-path", str(media_dir),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("llava-server") / "server.log"
    os.environ["PAGEDSERVE_MAX_IMAGE_BYTES"] = str(MAX_IMAGE_BYTES)  # the child's environment
    try:
        running = Server(llava_dir, log, None, args)
    finally:
        del os.environ["PAGEDSERVE_MAX_IMAGE_BYTES"]
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def llm(llava_dir: Path) -> LLM:
    return LLM(
        str(llava_dir), dtype="float32", device="cpu", max_model_len=256,
        num_gpu_blocks_override=64,
    )  # fmt: skip


def offline(llm: LLM, prompt: str, images: list[Image.Image]) -> Any:
    [output] = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False
    )
    return output


def chat(server: Server, messages: list[dict[str, Any]]) -> Any:
    return server.client().chat.completions.create(
        model=server.model, messages=messages, extra_body=IGNORE_EOS, **CHAT_PARAMS
    )


def test_chat_with_a_data_url_image_equals_offline_generate(server: Server, llm: LLM) -> None:
    """Greedy, whole and streamed: the same tokens as LLM.generate of the rendered prompt;
    usage's prompt_tokens and /tokenize count the image's tokens."""
    expected = offline(llm, ONE_RENDERED, [image(1)])
    messages = user(image_part(data_url(image(1))), text_part("What is in this picture?"))
    response = chat(server, messages)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert server.tokenize(messages=messages) == expected.prompt_token_ids

    stream = server.client().chat.completions.create(
        model=server.model, messages=messages, stream=True, extra_body=IGNORE_EOS,
        stream_options={"include_usage": True}, **CHAT_PARAMS,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def test_two_images_in_order(server: Server, llm: LLM) -> None:
    """Two image parts become two placeholders in part order; swapping them changes the
    output (each image reaches its own placeholder)."""
    first, second = image(2), image(3)
    expected = offline(llm, TWO_RENDERED, [first, second])
    swapped = offline(llm, TWO_RENDERED, [second, first])
    assert expected.outputs[0].text != swapped.outputs[0].text
    messages = user(
        image_part(data_url(first)), text_part("How do they differ?"), image_part(data_url(second))
    )
    response = chat(server, messages)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_file_and_http_urls(server: Server, llm: LLM, media_dir: Path, http_url: str) -> None:
    """A file:// URL under --allowed-local-media-path and an http URL give the data URL's
    output."""
    expected = offline(llm, ONE_RENDERED, [image(1)]).outputs[0].text
    for url in (f"file://{media_dir / 'cat.png'}", f"{http_url}/cat.png"):
        response = chat(server, user(image_part(url), text_part("What is in this picture?")))
        assert response.choices[0].message.content == expected, url


def test_bad_images_are_400s_naming_the_part(
    server: Server, llm: LLM, tmp_path: Path, http_url: str, media_dir: Path
) -> None:
    """Each failure is a 400 with OpenAI's error body and the part as `param`; the server
    keeps serving."""
    outside = tmp_path / "outside.png"
    outside.write_bytes(png(image(1)))
    link = media_dir / "link.png"  # inside the allowed folder, leading out of it
    if not link.exists():
        link.symlink_to(outside)
    good = image_part(data_url(image(1)))
    not_an_image = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    cases = [
        ([text_part("hi"), image_part(not_an_image)], "content[1]", "does not decode"),
        ([good, good, good], "content[2]", "at most 2 image"),
        ([image_part(f"{http_url}/missing.png")], "content[0]", "HTTP 404"),
        ([image_part("http://127.0.0.1:9/x.png")], "content[0]", "fetching the image failed"),
        ([image_part(f"{http_url}/big.png")], "content[0]", f"larger than {MAX_IMAGE_BYTES}"),
        ([image_part(f"{http_url}/unsized")], "content[0]", f"larger than {MAX_IMAGE_BYTES}"),
        ([image_part(f"file://{outside}")], "content[0]", "outside --allowed-local-media-path"),
        ([image_part(f"file://{link}")], "content[0]", "outside --allowed-local-media-path"),
        ([image_part(f"file://{media_dir}/none.png")], "content[0]", "cannot read the file"),
        ([image_part("ftp://host/x.png")], "content[0]", "unsupported image URL scheme"),
        ([image_part("data:image/png;base64,@@@")], "content[0]", "base64 is not valid"),
        ([text_part("hi"), {"type": "image"}], "content[1]", "has type 'image'"),
    ]
    for parts, where, message in cases:
        body = {"model": server.model, "messages": user(*parts), **CHAT_PARAMS}
        response = server.post("/v1/chat/completions", body)
        assert response.status_code == 400, (where, response.text)
        error = response.json()["error"]
        assert error["param"] == f"messages[0].{where}", error
        assert message in error["message"] and error["type"] == "BadRequestError", error
    expected = offline(llm, ONE_RENDERED, [image(1)]).outputs[0].text
    response = chat(server, user(good, text_part("What is in this picture?")))
    assert response.choices[0].message.content == expected


def test_an_image_for_a_text_only_model_is_a_400(fake_app: Any) -> None:
    """A text-only model's server refuses an image part, naming it."""
    messages = user(text_part("hi"), image_part(data_url(image(1))))
    for path, body in [
        ("/v1/chat/completions", {"model": "fake-model", "messages": messages}),
        ("/tokenize", {"messages": messages}),
    ]:
        response = fake_app.post(path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages[0].content[1]" and "text-only" in error["message"]
    assert fake_app.post("/tokenize", {"messages": user(text_part("hi"))}).status_code == 200


def test_run_batch_chat_with_an_image(server: Server, llava_dir: Path, tmp_path: Path) -> None:
    """`pagedserve run-batch` takes a chat line with an image as the server does."""
    import json
    import subprocess
    import sys

    messages = user(image_part(data_url(image(1))), text_part("What is in this picture?"))
    body = {"model": server.model, "messages": messages, **CHAT_PARAMS, **IGNORE_EOS}
    request = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(request) + "\n")
    command = [
        sys.executable, "-m", "pagedserve.entrypoints.cli", "run-batch", "-i", str(source),
        "-o", str(target), "--model", str(llava_dir), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 * 2**20),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = [json.loads(text) for text in target.read_text().splitlines()]
    assert result["error"] is None and result["response"]["status_code"] == 200, result
    expected = server.post("/v1/chat/completions", body).json()
    got = result["response"]["body"]
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["usage"] == expected["usage"]
