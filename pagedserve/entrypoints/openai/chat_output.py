"""Tool calling and reasoning in chat: which tools a request may call, the constraint that
makes `tool_choice="required"` / a named function produce parseable calls, and the split of
each choice's output into reasoning, content and tool calls, whole or streamed.

vLLM's rules (serving_chat): `tools` without `tool_choice` means "auto", which needs the
server's --enable-auto-tool-choice and --tool-call-parser; "none" renders the tools but
never parses calls; "required" constrains the output to a JSON array of
{"name", "parameters"} objects and a named function to its parameters' schema, both turned
into `tool_calls`. The reasoning (--reasoning-parser) is split off first; tools are parsed
in what follows it.
"""

import logging
from typing import Any

from pagedserve.reasoning import ReasoningParser, get_reasoning_parser
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.structured_output.backend_xgrammar import validate_structured_outputs

from .protocol import ChatCompletionRequest, DeltaMessage
from .protocol_tools import ChatCompletionNamedToolChoiceParam, ToolCall
from .serving import OpenAIError
from .tool_parsers import ParsedTools, PartialCall, ToolCallStreamer, ToolParser, get_tool_parser
from .tool_parsers.abstract import scan_calls
from .tool_parsers.json_spans import Scan, skip_ws

logger = logging.getLogger(__name__)

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def tool_choice_of(request: ChatCompletionRequest) -> str | ChatCompletionNamedToolChoiceParam:
    """The request's tool choice with OpenAI's default: "auto" with tools, else "none"."""
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def check_tool_request(
    request: ChatCompletionRequest, enable_auto_tools: bool, tool_parser: str | None
) -> None:
    """400 (param tool_choice) for a tool choice without tools, a named function that is
    not among them, and "auto" on a server started without auto tool choice (vLLM's
    messages)."""
    choice = tool_choice_of(request)
    if choice == "none":
        return
    if not request.tools:
        raise OpenAIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        if choice.function.name not in {tool.function.name for tool in request.tools}:
            raise OpenAIError(
                400,
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
    elif choice == "auto" and not (enable_auto_tools and tool_parser):
        raise OpenAIError(400, AUTO_NEEDS_FLAGS, "tool_choice")


_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def required_tools_schema(request: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's schema of `tool_choice="required"`: an array (at least one item) of
    {"name": one tool's name, "parameters": that tool's parameters}, any of the tools; the
    tools' `$defs` gathered at the top (a name defined twice differently is a 400)."""
    tools = request.tools or []
    defs: dict[str, Any] = {}
    choices = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise OpenAIError(
                    400, f"Tool definition '{name}' has multiple schemas, which is not "
                    "supported.", "tools",
                )  # fmt: skip
        choices.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices},
    }  # fmt: skip
    if defs:
        schema["$defs"] = defs
    return schema


def _check_parameters(tools: list[tuple[int, Any]]) -> None:
    """Raise InvalidRequestError (400) naming `tools.{i}.function.parameters` for the first
    of these (index, tool) pairs whose parameters are not a JSON schema the grammar engine
    can compile (their output is constrained to it)."""
    for index, tool in tools:
        schema = dict(tool.function.parameters or _NO_PARAMETERS)
        validate_structured_outputs(
            StructuredOutputsParams(json=schema), f"tools.{index}.function.parameters"
        )


def apply_tool_params(
    request: ChatCompletionRequest, params: SamplingParams, parses_auto_tools: bool
) -> None:
    """Set what tool calling needs in a request's SamplingParams: the JSON constraint of
    "required" or a named function; for "auto" with a parser, special tokens kept in the
    text (tool call markers are special tokens in some vocabularies; vLLM's parsers do this
    too). As in vLLM, the JSON may hold any whitespace unless the engine's
    --disable-any-whitespace is set. Raises OpenAIError 400 when the request constrains its
    output otherwise as well, InvalidRequestError (400) naming `tools.{i}.function.parameters`
    when a constrained tool's parameters are not a JSON schema."""
    choice = tool_choice_of(request)
    constraint = None
    tools = list(enumerate(request.tools or []))
    if choice == "required":
        _check_parameters(tools)
        constraint = required_tools_schema(request)
    elif isinstance(choice, ChatCompletionNamedToolChoiceParam):
        index, tool = next((i, t) for i, t in tools if t.function.name == choice.function.name)
        _check_parameters([(index, tool)])
        constraint = dict(tool.function.parameters or _NO_PARAMETERS)
    elif choice == "auto" and parses_auto_tools:
        params.skip_special_tokens = False
    if constraint is None:
        return
    if params.structured_outputs is not None:
        raise OpenAIError(
            400, "You can only either use constraints for structured outputs or tools, not "
            "both.", "tool_choice",
        )  # fmt: skip
    params.structured_outputs = StructuredOutputsParams(json=constraint)


class NamedToolParser(ToolParser):
    """A named function's output: all of it is that function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedTools | None:
        return ParsedTools("", [PartialCall(self.name, text)])


class RequiredToolParser(ToolParser):
    """`tool_choice="required"`: the output is [{"name": ..., "parameters": {...}}, ...]."""

    def __init__(self) -> None:
        super().__init__(None)

    def parse(self, text: str, final: bool) -> ParsedTools | None:
        pos = skip_ws(text, 0)
        if pos == len(text) or text[pos] != "[":
            return None if final or pos < len(text) else ParsedTools("")
        calls, state, pos = scan_calls(text, pos + 1, ("parameters",))
        if final and not (calls and state is Scan.COMPLETE and text.startswith("]", pos)):
            return None  # cut off (max_tokens): no calls, the text as content
        return ParsedTools("", calls if state is not Scan.INVALID else [])


class ChatOutputParser:
    """Splits one choice's output into (reasoning, content, tool calls): `parse` for a whole
    output, `delta` for a stream (one instance per choice; it keeps the stream's state).

    reasoning_parser / tool_parser: the server's --reasoning-parser and --tool-call-parser
    names (None: none); `parses_auto_tools`: the server allows "auto" (its flag).
    Raises ValueError when the tokenizer lacks the reasoning parser's marker tokens."""

    def __init__(
        self,
        tokenizer: Any,
        request: ChatCompletionRequest,
        reasoning_parser: str | None,
        tool_parser: str | None,
        parses_auto_tools: bool,
    ) -> None:
        self.request = request
        self.reasoning: ReasoningParser | None = None
        if reasoning_parser is not None:
            self.reasoning = get_reasoning_parser(
                reasoning_parser, tokenizer, chat_template_kwargs=request.chat_template_kwargs
            )
        choice = tool_choice_of(request)
        self.named = isinstance(choice, ChatCompletionNamedToolChoiceParam)
        self.required = choice == "required"
        self.tools: ToolParser | None = None
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            self.tools = NamedToolParser(choice.function.name)
        elif self.required:
            self.tools = RequiredToolParser()
        elif choice == "auto" and request.tools and parses_auto_tools and tool_parser:
            self.tools = get_tool_parser(tool_parser, tokenizer)
        self.single_call = request.parallel_tool_calls is False
        self.text = ""
        self.num_reasoning_chars = 0
        self.num_content_chars = 0
        self.streamer = self.tools.streamer if self.tools is not None else ToolCallStreamer()

    @property
    def active(self) -> bool:
        """Whether the output is parsed at all (else it is the content, as is)."""
        return self.reasoning is not None or self.tools is not None

    def _split_reasoning(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        reasoning, content = self.reasoning.extract_reasoning_partial(text, final)
        if not self.request.include_reasoning:
            reasoning = None
        return reasoning, content or ""

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool_calls) of a whole output."""
        reasoning, content = self._split_reasoning(text, True)
        # With a reasoning parser an absent answer is null (vLLM), else the text as is.
        plain = (content or None) if self.reasoning is not None else content
        whole = self.tools.parse_whole(content) if self.tools is not None else None
        if whole is None:
            return reasoning, plain, []  # no (well-formed) call: the text is the content
        calls = whole[1][: 1 if self.single_call else None]
        if self.named or self.required:
            return reasoning, "", calls  # vLLM's content of a forced call
        return reasoning, whole[0] or None, calls

    def delta(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """What `delta_text` adds to the message (None: nothing yet); `finished` releases
        what was held back."""
        self.text += delta_text
        reasoning, content = self._split_reasoning(self.text, finished)
        reasoning_delta = (reasoning or "")[self.num_reasoning_chars :]
        self.num_reasoning_chars += len(reasoning_delta)
        if self.tools is None:
            message = DeltaMessage(content=content[self.num_content_chars :] or None)
            self.num_content_chars = len(content)
        else:
            parsed = self.tools.parse_growing(content, finished)
            message = self.streamer.delta(parsed) or DeltaMessage()
        if self.single_call:
            message.tool_calls = [call for call in message.tool_calls if call.index == 0]
        message.reasoning = reasoning_delta or None
        if message.content is None and message.reasoning is None and not message.tool_calls:
            return None
        return message

    def finish_reason(
        self, finish_reason: str | None, tools_called: bool, whole: bool
    ) -> str | None:
        """OpenAI's finish_reason "tool_calls" (vLLM's rules): a whole response's when "auto"
        called tools, or "required" did and the output ended by itself; a stream's when
        tools were streamed, not for a named function, and the output ended by itself."""
        auto_called = tools_called and not (self.named or self.required)
        if whole and auto_called:
            return "tool_calls"
        if tools_called and not self.named and finish_reason == "stop":
            return "tool_calls"
        return finish_reason
