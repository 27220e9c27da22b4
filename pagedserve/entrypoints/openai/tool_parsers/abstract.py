"""The tool parser base class, its registry, and the streaming of tool calls.

Source: vLLM's `ToolParser` / `ToolParserManager` (`--tool-call-parser NAME`). A parser says
what a model's output holds (`parse`); `extract_tool_calls` (a whole output) and
`extract_tool_calls_streaming` (one delta of a stream) are built on it, so that the pieces a
stream sends join to what a whole response holds.
"""

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.entrypoints.openai.protocol import DeltaMessage
from pagedserve.entrypoints.openai.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from pagedserve.reasoning.base import partial_marker_len

from .json_spans import ObjectScan, Scan, scan_object, skip_ws

# vLLM's names of the parsers pagedserve has (--tool-call-parser's choices).
TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


@dataclass
class PartialCall:
    """A tool call as far as the output has written it: `name` (None until known) and the
    `arguments` JSON text so far (a prefix of the final text)."""

    name: str | None
    arguments: str


@dataclass
class ParsedTools:
    """What an output (so far) holds: the content text before the calls, and the calls."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ExtractedToolCallInformation:
    """vLLM's result of a whole output: whether it called tools, the calls, the content
    around them (None when empty); without calls, the content is the whole output."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


class ToolCallStreamer:
    """Turns growing parses of an output into OpenAI's stream deltas: content text as it
    becomes certain; per call, a first delta with index, id, type "function" and the name
    (and the argument text so far), then argument text. Every piece is the growth of a
    prefix, so the pieces join to the final parse."""

    def __init__(self, make_id: Callable[[], str] = make_tool_call_id) -> None:
        self.make_id = make_id
        self.num_content_chars = 0
        self.sent: list[list[Any]] = []  # per call: [id, argument characters sent]

    @property
    def tools_called(self) -> bool:
        return bool(self.sent)

    def delta(self, parsed: ParsedTools) -> DeltaMessage | None:
        content = parsed.content[self.num_content_chars :]
        self.num_content_chars = max(self.num_content_chars, len(parsed.content))
        pieces = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a call's first delta carries its name
            if index == len(self.sent):
                self.sent.append([self.make_id(), len(call.arguments)])
                function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
                pieces.append(
                    DeltaToolCall(index=index, id=self.sent[index][0], type="function",
                                  function=function)
                )  # fmt: skip
                continue
            arguments = call.arguments[self.sent[index][1] :]
            if arguments:
                self.sent[index][1] = len(call.arguments)
                function = DeltaFunctionCall(arguments=arguments)
                pieces.append(DeltaToolCall(index=index, function=function))
        if not content and not pieces:
            return None
        return DeltaMessage(content=content or None, tool_calls=pieces)


class ToolParser(ABC):
    """Finds the tool calls in a model's output. One instance per choice of a request (a
    stream keeps its state here). tokenizer: the model's (unused by the text-based parsers
    here; vLLM's take it too)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.streamer = ToolCallStreamer(self.make_id)

    def make_id(self) -> str:
        return make_tool_call_id()

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedTools | None:
        """The content and calls of `text`. final=False: the output may still grow; give
        only what is certain (content and argument texts that only grow from now on).
        final=True: the whole output; None when it is not a well-formed tool call output
        (then all of it is content)."""

    def parse_whole(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) of a whole output; None unless it holds well-formed calls, each
        with a name (then all of it is content)."""
        parsed = self.parse(text, final=True)
        if parsed is None or not parsed.calls or any(c.name is None for c in parsed.calls):
            return None
        calls = [
            ToolCall(id=self.make_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.calls
            if c.name is not None
        ]
        return parsed.content, calls

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The tool calls of a whole output (vLLM's name)."""
        whole = self.parse_whole(model_output)
        if whole is None:
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, whole[1], whole[0] or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        """What `delta_text` adds (vLLM's name; its token-id arguments are not needed by these
        text-based parsers). `finished`: the output is complete, so what was held back (a
        cut-off marker, a would-be call that is not one) is sent now. None: nothing yet."""
        return self.streamer.delta(self.parse_growing(current_text, finished))

    def parse_growing(self, text: str, finished: bool) -> ParsedTools:
        """The parse a stream sends the growth of: at the end, that of `parse_whole`."""
        parsed = self.parse(text, final=finished)
        if finished and (parsed is None or any(c.name is None for c in parsed.calls)):
            return ParsedTools(text)
        return parsed if parsed is not None else ParsedTools(text)


def content_before(text: str, marker: str, final: bool) -> tuple[int, ParsedTools | None]:
    """Where the first `marker` (the start of the calls) is (-1: nowhere), and the parse so
    far: the content before it; without it, the text (a whole output: None, no calls), less
    a cut-off marker at its end while the output may still grow."""
    first = text.find(marker)
    if first >= 0:
        return first, ParsedTools(text[:first])
    if final:
        return -1, None
    return -1, ParsedTools(text[: len(text) - partial_marker_len(text, marker)])


def call_of_object(text: str, scan: ObjectScan, argument_keys: tuple[str, ...]) -> PartialCall:
    """The call an object {"name": ..., "arguments"/"parameters": {...}} holds (so far).
    A cut-off arguments value gives its text so far; a complete object without one gives
    "{}". Raises ValueError when the name is not a string."""
    name = None
    if "name" in scan.fields:
        start, end = scan.fields["name"]
        if end is not None:
            name = json.loads(text[start:end])
            if not isinstance(name, str):
                raise ValueError("the tool call's name is not a string")
    arguments = "{}" if scan.state is Scan.COMPLETE else ""
    for key in argument_keys:
        if key in scan.fields:
            start, end = scan.fields[key]
            arguments = text[start:end] if end is not None else text[start:]
            break
    return PartialCall(name, arguments)


def scan_calls(
    text: str, pos: int, argument_keys: tuple[str, ...], separators: str = ","
) -> tuple[list[PartialCall], Scan, int]:
    """The call objects from text[pos] on, each followed by whitespace and one of
    `separators` (or the end): the calls, how the last one ends, and where the scan
    stopped. INVALID for text that is not an object where one should start, or a bad name."""
    calls: list[PartialCall] = []
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return calls, Scan.COMPLETE if calls else Scan.PARTIAL, pos
        if text[pos] != "{":  # after the calls: the caller judges what follows
            return calls, Scan.COMPLETE if calls else Scan.INVALID, pos
        scan = scan_object(text, pos)
        if scan.state is Scan.INVALID:
            return calls, Scan.INVALID, pos
        try:
            calls.append(call_of_object(text, scan, argument_keys))
        except ValueError:
            return calls, Scan.INVALID, pos
        if scan.end is None:
            return calls, Scan.PARTIAL, pos
        pos = skip_ws(text, scan.end)
        if pos < len(text) and text[pos] in separators:
            pos += 1


_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator registering a parser under `name` (one of TOOL_PARSERS)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"{name!r} is not in TOOL_PARSERS {TOOL_PARSERS}")

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _REGISTRY[name] = cls
        return cls

    return register


def get_tool_parser(name: str, tokenizer: Any) -> ToolParser:
    """A new parser `name` for one choice. Raises ValueError listing the valid names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown tool call parser {name!r}; valid names: {sorted(_REGISTRY)}")
    return _REGISTRY[name](tokenizer)
