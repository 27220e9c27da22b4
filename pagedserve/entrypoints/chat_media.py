"""Images of chat messages: OpenAI's `image_url` content parts loaded as PIL images (vLLM's
MediaConnector): `data:image/...;base64,...` URLs, `file://` paths under
--allowed-local-media-path, and http(s) URLs fetched with a timeout and a size cap.

Each error is an InvalidRequestError (HTTP 400) whose param names the content part, e.g.
"messages[0].content[1]".
"""

import base64
import binascii
import io
import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve import envs
from pagedserve.config import ModelConfig
from pagedserve.engine.mm_processor import MultiModalProcessor
from pagedserve.errors import InvalidRequestError

_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class MediaOptions:
    """Whether and how chat messages may hold images.

    mm_processor: the model's (None: a text-only model; image parts are refused).
    max_images: --limit-mm-per-prompt's "image" (vLLM's flag; default 999).
    allowed_local_media_path: --allowed-local-media-path ("": no file:// URLs).
    fetch_timeout_s, max_image_bytes: of one http(s) or file image
    (PAGEDSERVE_IMAGE_FETCH_TIMEOUT, PAGEDSERVE_MAX_IMAGE_BYTES)."""

    mm_processor: MultiModalProcessor | None = None
    max_images: int = 0
    allowed_local_media_path: str = ""
    fetch_timeout_s: float = 5.0
    max_image_bytes: int = 20 * 2**20

    @property
    def image_placeholder(self) -> str | None:
        """The model's image placeholder text (None: a text-only model)."""
        return None if self.mm_processor is None else self.mm_processor.image_placeholder

    def chat_template(self, tokenizer: Any, given: str | None) -> str | None:
        """The template a chat is rendered with: `given` (--chat-template), else the
        tokenizer's, else the processor's (None: the tokenizer's, which render_chat refuses
        when there is none)."""
        if given is not None or getattr(tokenizer, "chat_template", None) is not None:
            return given
        return None if self.mm_processor is None else self.mm_processor.chat_template

    @classmethod
    def of_model(
        cls, model_config: ModelConfig, mm_processor: MultiModalProcessor | None
    ) -> "MediaOptions":
        """The options of an engine: its model config's flags and the environment's limits."""
        return cls(
            mm_processor,
            model_config.mm_limit("image"),
            model_config.allowed_local_media_path,
            envs.image_fetch_timeout(),
            envs.max_image_bytes(),
        )


def load_chat_images(messages: Sequence[Any], options: MediaOptions) -> tuple[list[Any], list[Any]]:
    """(the messages with each `{"type": "image_url", "image_url": {"url": ...}}` part
    replaced by `{"type": "image"}`, which chat templates turn into the image placeholder;
    the images as RGB PIL images, in message and part order). Messages that are not dicts
    pass unchanged (normalize_messages refuses them). Raises InvalidRequestError naming the
    part for a client's own {"type": "image"} part, an image sent to a text-only model,
    more images than `max_images`, a URL that cannot be read, or bytes that are not an
    image."""
    result: list[Any] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list | tuple):
            result.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            part_type = part.get("type") if isinstance(part, Mapping) else None
            where = f"messages[{i}].content[{j}]"
            if part_type == "image":  # ours only: it would be a placeholder without pixels
                raise InvalidRequestError(
                    f"{where} has type 'image', which pagedserve does not take from clients; "
                    f"send an image as {{'type': 'image_url', 'image_url': {{'url': ...}}}}",
                    where,
                )
            if part_type != "image_url":
                parts.append(part)
                continue
            _check_room(options, len(images), where)
            images.append(load_image(_part_url(part, where), options, where))
            parts.append({"type": "image"})
        result.append({**message, "content": parts})
    return result, images


def _check_room(options: MediaOptions, num_images: int, where: str) -> None:
    if options.mm_processor is None:
        raise InvalidRequestError(
            f"{where} is an image, but this model is text-only: it takes no images; send "
            f"text parts only, or serve a vision-language model (LlavaForConditionalGeneration)",
            where,
        )
    if num_images >= options.max_images:
        raise InvalidRequestError(
            f"{where}: at most {options.max_images} image(s) per prompt "
            f"(--limit-mm-per-prompt '{{\"image\": {options.max_images}}}'); send fewer images "
            f"or start the server with a higher limit",
            where,
        )


def _part_url(part: Mapping[str, Any], where: str) -> str:
    """The URL of an image_url part: OpenAI's {"url": ...} object (or a bare string, as
    vLLM also accepts)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(
            f"{where}.image_url.url must be a non-empty string (a data:, file:// or http(s) URL)",
            where,
        )
    return url


def load_image(url: str, options: MediaOptions, where: str) -> Any:
    """The RGB PIL image of a `data:`, `file://` or http(s) URL."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, where)
    elif scheme == "file":
        data = _file_bytes(url, options, where)
    elif scheme in ("http", "https"):
        data = _fetch(url, options, where)
    else:
        raise InvalidRequestError(
            f"{where}: unsupported image URL scheme {scheme or url[:20]!r}; use a "
            f"data:image/...;base64 URL, a file:// URL under --allowed-local-media-path, or an "
            f"http(s) URL",
            where,
        )
    return _decode(data, where)


def _data_url_bytes(url: str, where: str) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None or ";base64" not in match["params"]:
        raise InvalidRequestError(
            f"{where}: a data URL must be data:image/...;base64,<base64 bytes>", where
        )
    try:
        return base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the data URL's base64 is not valid", where) from None


def _file_bytes(url: str, options: MediaOptions, where: str) -> bytes:
    """A local file's bytes; only under --allowed-local-media-path (symlinks resolved, so a
    link cannot lead out of it)."""
    if not options.allowed_local_media_path:
        raise InvalidRequestError(
            f"{where}: file:// image URLs are refused: the server was started without "
            f"--allowed-local-media-path",
            where,
        )
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"{where}: a file URL must name a local path", where)
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(options.allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise InvalidRequestError(
            f"{where}: the file is outside --allowed-local-media-path ({root})", where
        )
    try:
        if os.path.getsize(path) > options.max_image_bytes:
            raise InvalidRequestError(
                f"{where}: the file is larger than {options.max_image_bytes} bytes "
                f"(PAGEDSERVE_MAX_IMAGE_BYTES)",
                where,
            )
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidRequestError(f"{where}: cannot read the file: {e.strerror}", where) from None


def _fetch(url: str, options: MediaOptions, where: str) -> bytes:
    """GET an image, stopping as soon as it passes the size cap (the Content-Length is not
    trusted: a chunked body has none)."""
    import httpx

    limit = options.max_image_bytes
    too_big = InvalidRequestError(
        f"{where}: the image at the URL is larger than {limit} bytes (PAGEDSERVE_MAX_IMAGE_BYTES)",
        where,
    )
    try:
        with httpx.stream(
            "GET", url, timeout=options.fetch_timeout_s, follow_redirects=True
        ) as response:
            if response.status_code != 200:
                raise InvalidRequestError(
                    f"{where}: fetching the image failed: HTTP {response.status_code}", where
                )
            if int(response.headers.get("content-length") or 0) > limit:
                raise too_big
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except httpx.HTTPError as e:  # connection refused, timeout, bad URL
        raise InvalidRequestError(
            f"{where}: fetching the image failed ({type(e).__name__}: {e}; timeout "
            f"{options.fetch_timeout_s} s, PAGEDSERVE_IMAGE_FETCH_TIMEOUT)",
            where,
        ) from None
    return b"".join(chunks)


def _decode(data: bytes, where: str) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")  # as vLLM: the processors expect 3 channels
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, OSError, bombs)
        raise InvalidRequestError(
            f"{where}: the image does not decode ({type(e).__name__}); send a PNG, JPEG, "
            f"GIF or WebP image",
            where,
        ) from None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat: the template's text, its token ids and the chat's images (RGB PIL
    images, in the order of their placeholders in `text`)."""

    text: str
    # The text's tokens; with images, each placeholder still one token (the engine's
    # processor expands it to the image's tokens: see `prompt_token_ids`).
    token_ids: list[int]
    images: list[Any]

    def engine_prompt(self) -> dict[str, Any]:
        """The prompt for the engine: token ids, or with images the text and
        multi_modal_data (vLLM's TextPrompt)."""
        if self.images:
            return {"prompt": self.text, "multi_modal_data": {"image": self.images}}
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}

    def prompt_token_ids(self, options: MediaOptions) -> list[int]:
        """The ids the engine runs: with images, the processor's (placeholders expanded)."""
        if not self.images:
            return self.token_ids
        assert options.mm_processor is not None  # load_chat_images refused images otherwise
        token_ids, _ = options.mm_processor.process(self.text, {"image": self.images})
        return token_ids
