"""Chat messages to a prompt, shared by the offline `LLM.chat` and the server's chat endpoints.

No FastAPI here: the offline path imports it. Errors are InvalidRequestError (a ValueError,
HTTP 400 on the server) naming the request field at fault.
"""

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from pagedserve.engine.prompt_bound import check_prompt_chars
from pagedserve.entrypoints.openai.protocol_tools import ChatCompletionToolsParam
from pagedserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Message keys passed on to the template besides role, content, tool_calls and the
# reasoning (vLLM passes these too).
_PASSED_KEYS = ("name", "tool_call_id")


def _content_parts(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as a list of parts, {"type": "text", "text": str} or
    {"type": "image"} (an image_url part after `chat_media.load_chat_images`): vLLM's
    "openai" content format, which multimodal templates iterate over. A string is one text
    part, None none."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list | tuple):
        raise InvalidRequestError(
            f"{where}.content must be a string, a list of content parts or null, "
            f"got {type(content).__name__}",
            "messages",
        )
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, Mapping) else None
        if part_type == "image":
            parts.append({"type": "image"})
            continue
        if part_type != "text":
            described = repr(part_type) if part_type is not None else type(part).__name__
            raise InvalidRequestError(
                f"{where}.content[{i}] has type {described}, which pagedserve does not "
                f"support: content parts must be text ({{'type': 'text', 'text': ...}}) or, "
                f"for a vision-language model, image_url",
                "messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"{where}.content[{i}].text must be a string, got {type(text).__name__}",
                "messages",
            )
        parts.append({"type": "text", "text": text})
    return parts


def _content_text(content: Any, where: str, image_placeholder: str | None = None) -> str:
    """A message's content as one string: text parts joined by newlines (vLLM's "string"
    content format, which text-only templates expect). Image parts become
    `image_placeholder` (the model's, e.g. "<image>"), first and one per line, as vLLM
    renders images for a string-content template; without one they are refused."""
    parts = _content_parts(content, where)
    num_images = sum(part["type"] == "image" for part in parts)
    if num_images and image_placeholder is None:  # only after load_chat_images
        raise InvalidRequestError(
            f"{where} holds an image, but the chat is rendered as text (a text-only model)",
            "messages",
        )
    texts = [part["text"] for part in parts if part["type"] == "text"]
    return "\n".join([str(image_placeholder)] * num_images + texts)


# A template that iterates over a message's content (or filters it) takes content parts
# (vLLM's "openai" content format; vLLM finds such loops in the template's Jinja syntax tree,
# this pattern in its text); any other takes a string.
_ITERATES_CONTENT = re.compile(
    r"""for\s+\w+\s+in\s+\w+(\[[^\]]*\])*?(\[['"]content['"]\]|\.content\b)"""
    r"""|(\[['"]content['"]\]|\.content)\s*\|\s*(selectattr|rejectattr|select|reject|map)"""
)


def takes_content_parts(template: Any) -> bool:
    """Whether a chat template (Jinja text) renders content parts rather than a string."""
    return isinstance(template, str) and _ITERATES_CONTENT.search(template) is not None


def _tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's tool calls as templates take them: each function's `arguments` a dict
    (clients send OpenAI's JSON text; Hugging Face templates expect the object, and vLLM
    parses it too). Raises InvalidRequestError for a call without a function name, or
    arguments that are not a JSON object."""
    if not isinstance(tool_calls, list | tuple):
        raise InvalidRequestError(f"{where}.tool_calls must be a list", "messages")
    calls = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(
                f"{where}.tool_calls[{i}] needs a function with a name", "messages"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise InvalidRequestError(
                    f"{where}.tool_calls[{i}].function.arguments is not valid JSON: {e}",
                    "messages",
                ) from None
        elif arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidRequestError(
                f"{where}.tool_calls[{i}].function.arguments must be a JSON object", "messages"
            )
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return calls


def normalize_messages(
    messages: Sequence[Mapping[str, Any]],
    content_parts: bool = False,
    image_placeholder: str | None = None,
) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: `content` a string (text parts joined by
    newlines, None as "", image parts as `image_placeholder`), or with `content_parts` (a
    template that iterates over the content) a list of {"type": "text", "text"} and
    {"type": "image"} parts; the "developer" role as "system" (OpenAI's newer name for it).

    messages: dicts with "role" (a string) and "content" (a string, None, or a list of
    {"type": "text", "text": str} parts); "name" and "tool_call_id" pass through;
    "tool_calls" with each function's arguments parsed to a dict; the earlier thinking
    ("reasoning", or its older name "reasoning_content") under both names (templates read
    either). Raises InvalidRequestError (param "messages") for an empty list, a message
    that is not a dict or has no role, any content part other than text (naming its type),
    and a malformed tool call.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of messages", "messages")

    def content_of(content: Any, where: str) -> Any:
        if content_parts:
            return _content_parts(content, where)
        return _content_text(content, where, image_placeholder)

    normalized = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}",
                "messages",
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where} needs a 'role' string", "messages")
        item: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": content_of(message.get("content"), where),
        }
        for key in _PASSED_KEYS:
            if message.get(key) is not None:
                item[key] = message[key]
        if message.get("tool_calls") is not None:
            item["tool_calls"] = _tool_calls(message["tool_calls"], where)
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            item["reasoning"] = item["reasoning_content"] = reasoning
        normalized.append(item)
    return normalized


def normalize_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's tool list checked as the server's request model checks it
    (`ChatCompletionToolsParam`: {"type": "function", "function": {"name": non-empty str,
    "description"?, "parameters"?: dict, "strict"?}}) and dumped as the server passes it to
    the template (None fields left out, unknown keys dropped). Raises InvalidRequestError
    (param "tools") for a non-list and for the first malformed tool, naming where, e.g.
    "tools[0].function.name: Field required"."""
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise InvalidRequestError(
            f"tools must be a list of tools, got {type(tools).__name__}", "tools"
        )
    normalized = []
    for i, tool in enumerate(tools):
        try:
            param = ChatCompletionToolsParam.model_validate(tool)
        except ValidationError as e:
            first = e.errors()[0]
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
            raise InvalidRequestError(f"tools[{i}]{loc}: {first['msg']}", "tools") from None
        normalized.append(param.model_dump(exclude_none=True))
    return normalized


def chat_template_error(exc: Exception) -> InvalidRequestError:
    """The error of a chat template that failed on a conversation. Only a template's own
    `raise_exception("...")` (a plain jinja2 TemplateError) is worded for users, so only its
    message is passed on; any other error (a missing field, a type error, a bad keyword in
    chat_template_kwargs) names internal functions and variables: it goes to the log (and
    stays the raised error's __cause__ for offline callers)."""
    import jinja2

    if type(exc) is jinja2.TemplateError:
        return InvalidRequestError(f"the chat template refused these messages: {exc}", "messages")
    logger.info("chat template failed: %r", exc)
    return InvalidRequestError(
        "the chat template could not render these messages; check their roles and content, "
        "and chat_template_kwargs",
        "messages",
    )


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_special_tokens: bool = False,
    max_model_len: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    image_placeholder: str | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and token ids of a conversation (`normalize_messages`, then the chat
    template, then the tokenizer).

    chat_template: Jinja text; None uses the tokenizer's. With `continue_final_message` the
    last (assistant) message is left open and no generation prompt is added.
    add_special_tokens: vLLM's chat field of that name: add the tokenizer's special tokens
    (e.g. BOS) when encoding the rendered text, on top of what the template holds. Default
    False: templates hold their BOS, so the ids equal `apply_chat_template(...,
    tokenize=True)`. max_model_len (None: no check) refuses a text too long to fit before
    encoding it. tools: OpenAI's tool list ({"type": "function", "function": {"name",
    "description", "parameters"}}), checked by `normalize_tools` and given to the template
    as `tools` (templates without tool support ignore it). image_placeholder: a
    vision-language model's (e.g. "<image>"; None: a text-only model), whose messages'
    image parts `chat_media.load_chat_images` made {"type": "image"}: a template that
    iterates over the content gets the parts (llava-hf's writes the placeholder itself),
    another the text with the placeholder (`normalize_messages`); the token ids then hold
    each image's one unexpanded placeholder (the engine's processor expands them).
    Raises InvalidRequestError: no template, bad messages or tools, a template that fails
    on them.
    """
    if tokenizer is None:
        raise InvalidRequestError(
            "chat needs a tokenizer; this engine has none (skip_tokenizer_init)", "messages"
        )
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; give one (LLM.chat(chat_template="
            "...), or the server's --chat-template FILE), or use a plain text prompt",
            "messages",
        )
    content_parts = image_placeholder is not None and takes_content_parts(
        chat_template if chat_template is not None else tokenizer.chat_template
    )
    conversation = normalize_messages(messages, content_parts, image_placeholder)
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise InvalidRequestError(
            "continue_final_message needs the last message to be from the assistant, "
            f"got {conversation[-1]['role']!r}",
            "continue_final_message",
        )
    # chat_template_kwargs win over the tools, as in vLLM
    checked = normalize_tools(tools) if tools is not None else []
    template_kwargs = {"tools": checked or None}
    template_kwargs.update(chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **template_kwargs,
        )
    except Exception as e:  # the template refused these messages
        raise chat_template_error(e) from e
    if max_model_len is not None:  # refuse megabytes before tokenizing them
        check_prompt_chars(tokenizer, text, max_model_len, "messages")
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
