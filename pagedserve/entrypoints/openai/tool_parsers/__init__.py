"""Tool call parsers (`--tool-call-parser NAME`): find the tool calls in a model's output,
whole or streamed. vLLM's names: hermes, llama3_json, mistral, pythonic (TOOL_PARSERS); each
module registers its parser when imported here."""

from . import hermes, llama3_json, mistral, pythonic
from .abstract import (
    TOOL_PARSERS,
    ExtractedToolCallInformation,
    ParsedTools,
    PartialCall,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
)

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCallInformation",
    "ParsedTools",
    "PartialCall",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "hermes",
    "llama3_json",
    "mistral",
    "pythonic",
    "register_tool_parser",
]
