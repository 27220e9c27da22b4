"""`--tool-call-parser pythonic` (Llama 3.2, ToolACE, other models that write calls as
Python): vLLM's PythonicToolParser.

The whole output is a Python list of calls with keyword arguments of literal values,
`[get_weather(city="Paris", days=3), get_time()]`; each call's arguments become a JSON object
(`json.dumps` of the literals). Anything else is content. While streaming, a call's name is
sent once its "(" is written and its arguments once its ")" closes it.
"""

import ast
import json
import re

from .abstract import ParsedTools, PartialCall, ToolParser, register_tool_parser

# What an output that is (or may become) a call list starts like.
_MAY_BE_CALLS = re.compile(r"\s*(\[\s*([A-Za-z_][\w.]*\s*(\(.*)?)?)?\Z", re.DOTALL)
_CALL_START = re.compile(r"[\s,]*([A-Za-z_][\w.]*)\s*\(")
_KEYWORDS_START = re.compile(r"\s*(\)|[A-Za-z_]\w*\s*=)")


def _arguments(call: ast.expr) -> tuple[str, str]:
    """(name, JSON arguments) of one call node; ValueError unless it is `name(k=literal...)`."""
    if not isinstance(call, ast.Call) or call.args:
        raise ValueError("not a call with keyword arguments only")
    name = ast.unparse(call.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        raise ValueError(f"not a function name: {name}")
    values = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs in a call")
        values[keyword.arg] = ast.literal_eval(keyword.value)
    return name, json.dumps(values, ensure_ascii=False)


def _call_ends(text: str, start: int) -> int | None:
    """Index just after the ")" closing the call whose "(" is at `start`; None if open."""
    depth = 0
    quote = ""
    i = start
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif char in "\"'":
            quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else char
            i += len(quote) - 1
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """See the module docstring."""

    def parse(self, text: str, final: bool) -> ParsedTools | None:
        if final:
            return self._parse_whole(text)
        if not _MAY_BE_CALLS.match(text):
            return ParsedTools(text)
        parsed = ParsedTools("")
        pos = text.find("[") + 1
        while pos > 0:
            match = _CALL_START.match(text, pos)
            if match is None:
                break
            end = _call_ends(text, match.end() - 1)
            if end is None:
                # Its name is sent once the arguments are seen to be keywords (or none).
                if _KEYWORDS_START.match(text, match.end()):
                    parsed.calls.append(PartialCall(match.group(1), ""))
                break
            try:
                name, arguments = _arguments(
                    ast.parse(text[match.start(1) : end], mode="eval").body
                )
            except (SyntaxError, ValueError):
                break  # not a call after all: the whole output decides
            parsed.calls.append(PartialCall(name, arguments))
            pos = end
        return parsed

    def _parse_whole(self, text: str) -> ParsedTools | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = [PartialCall(*_arguments(node)) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None
        return ParsedTools("", calls)
