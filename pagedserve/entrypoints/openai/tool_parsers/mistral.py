"""`--tool-call-parser mistral` (Mistral 7B v0.3, Mistral Nemo/Small/Large): vLLM's
MistralToolParser.

Content, then `[TOOL_CALLS]` and a JSON array `[{"name": "f", "arguments": {...}}, ...]`
(tokenizers before v11), or `[TOOL_CALLS]f[ARGS]{...}` per call (v11 and later). Tool call
ids are 9 letters and digits, as Mistral's templates require. The marker is found in the text,
so the request must keep special tokens (the server sets skip_special_tokens=False, as vLLM).
"""

import random
import string

from .abstract import (
    ParsedTools,
    PartialCall,
    ToolParser,
    content_before,
    register_tool_parser,
    scan_calls,
)
from .json_spans import Scan, scan_object, skip_ws

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """See the module docstring."""

    def make_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def parse(self, text: str, final: bool) -> ParsedTools | None:
        first, parsed = content_before(text, BOT, final)
        if first < 0 or parsed is None:
            return parsed
        pos = skip_ws(text, first + len(BOT))
        if pos >= len(text):
            return None if final else parsed
        if text[pos] == "[":
            calls, state, pos = scan_calls(text, pos + 1, ("arguments",))
            parsed.calls = calls
            if state is Scan.INVALID:
                return None if final else ParsedTools(parsed.content)
            if final and not (calls and text.startswith("]", pos)):
                return None
            return parsed
        return self._parse_v11(text, first, parsed, final)

    def _parse_v11(
        self, text: str, start: int, parsed: ParsedTools, final: bool
    ) -> ParsedTools | None:
        """`[TOOL_CALLS]name[ARGS]{json}` repeated."""
        while start >= 0:
            name_start = start + len(BOT)
            args_at = text.find(ARGS, name_start)
            if args_at < 0:
                return None if final else parsed  # the name is still being written
            name = text[name_start:args_at].strip()
            args_start = args_at + len(ARGS)
            scan = scan_object(text, skip_ws(text, args_start))
            if not name or scan.state is not Scan.COMPLETE or scan.end is None:
                if final or scan.state is Scan.INVALID or not name:
                    return None if final else parsed
                parsed.calls.append(PartialCall(name, text[skip_ws(text, args_start) :]))
                return parsed
            parsed.calls.append(PartialCall(name, text[skip_ws(text, args_start) : scan.end]))
            start = text.find(BOT, scan.end)
            if start < 0 and final and skip_ws(text, scan.end) != len(text):
                return None
        return parsed
