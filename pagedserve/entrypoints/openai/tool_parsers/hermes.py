"""`--tool-call-parser hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): vLLM's Hermes2ProToolParser.

The model writes content, then each call as
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`; the content is the text
before the first call (text between and after calls is dropped, as vLLM does).
"""

from .abstract import ParsedTools, ToolParser, call_of_object, content_before, register_tool_parser
from .json_spans import Scan, scan_object, skip_ws

START = "<tool_call>"
END = "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """See the module docstring. A last call whose `</tool_call>` never came (the output
    stopped at EOS) still counts when its JSON is whole; any malformed call makes the whole
    output content (vLLM's rule)."""

    def parse(self, text: str, final: bool) -> ParsedTools | None:
        first, parsed = content_before(text, START, final)
        if first < 0 or parsed is None:
            return parsed
        start = first
        while start >= 0:
            body_start = skip_ws(text, start + len(START))
            close = text.find(END, body_start)
            scan = scan_object(text[: close if close >= 0 else len(text)], body_start)
            try:
                call = call_of_object(text, scan, ("arguments",))
            except ValueError:
                return None if final else parsed
            whole = scan.end is not None and (close < 0 or skip_ws(text, scan.end) == close)
            if scan.state is Scan.INVALID or (close >= 0 and not whole):
                return None if final else parsed  # not a call: vLLM gives all as content
            parsed.calls.append(call)
            if scan.end is None:  # cut off by the end of the output
                return None if final else parsed
            start = text.find(START, close + len(END)) if close >= 0 else -1
        return parsed
