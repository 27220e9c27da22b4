"""`--tool-call-parser llama3_json` (Llama 3.1/3.2/3.3 JSON tool calls): vLLM's
Llama3JsonToolParser.

The whole output is the calls: an optional `<|python_tag|>`, then JSON objects
`{"name": "f", "parameters": {...}}` ("arguments" also taken) separated by ";". Anything else
(text before or after them, a malformed object) makes the whole output content, as in vLLM.
"""

from .abstract import ParsedTools, ToolParser, register_tool_parser, scan_calls
from .json_spans import Scan, skip_ws

BOT = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """See the module docstring. While streaming, an output that begins like a call (with
    "{" or the python tag) is held back until it is one or the output ends."""

    def parse(self, text: str, final: bool) -> ParsedTools | None:
        pos = skip_ws(text, 0)
        if text.startswith(BOT, pos):
            pos += len(BOT)
        elif not text.startswith("{", pos):
            if final:
                return None
            maybe_tag = BOT.startswith(text[pos:])  # "" or a cut-off "<|python"
            return ParsedTools("" if maybe_tag else text)
        calls, state, pos = scan_calls(text, pos, ("parameters", "arguments"), separators=";")
        if final and (state is not Scan.COMPLETE or skip_ws(text, pos) != len(text)):
            return None
        return ParsedTools("", calls)
