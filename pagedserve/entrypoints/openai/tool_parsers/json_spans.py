"""Where the parts of a JSON object are in a model's output, while the output still grows.

A tool call's `arguments` is the model's own JSON text (its span), so that a stream can send
it piece by piece as it is written and the pieces join to exactly what a whole response
holds (vLLM re-serializes the parsed arguments instead, whose pieces cannot be sent before
the object is complete).
"""

import json
from dataclasses import dataclass, field
from enum import Enum
from json.decoder import scanstring  # type: ignore[attr-defined]  # C speed-up, untyped

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


class Scan(Enum):
    """How far a JSON value goes: whole, cut off by the end of the text, or not JSON."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    INVALID = "invalid"


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


@dataclass
class ObjectScan:
    """The fields of a JSON object starting in a text: key -> (start, end) of its value's
    text, end None for a value cut off by the end of the text; `end`: just after "}"."""

    state: Scan
    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None


def _value_end(text: str, start: int) -> int | None:
    """End of the JSON value at `start`; None when the text ends inside it (or it is not
    JSON: the caller tells them apart by the text's end). A number reaching the end of the
    text may still grow, so it counts as cut off."""
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    if end == len(text) and text[start] in "-0123456789":
        return None
    return end


def scan_object(text: str, pos: int) -> ObjectScan:
    """Scan the JSON object at text[pos] (after any whitespace the caller skipped).

    PARTIAL: a prefix of an object (the fields seen so far; the last one may be cut off);
    INVALID: not an object. A malformed value inside it reads as PARTIAL (indistinguishable
    from one still being written); a caller with the whole output treats PARTIAL as invalid.
    """
    scan = ObjectScan(Scan.PARTIAL)
    if pos >= len(text):
        return scan
    if text[pos] != "{":
        return ObjectScan(Scan.INVALID)
    pos = skip_ws(text, pos + 1)
    if text.startswith("}", pos):
        return ObjectScan(Scan.COMPLETE, {}, pos + 1)
    while True:
        if pos >= len(text):
            return scan
        if text[pos] != '"':
            return ObjectScan(Scan.INVALID)
        try:
            key, pos = scanstring(text, pos + 1)
        except ValueError:  # the key is still being written
            return scan
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return scan
        if text[pos] != ":":
            return ObjectScan(Scan.INVALID)
        start = skip_ws(text, pos + 1)
        end = _value_end(text, start)
        scan.fields[key] = (start, end)
        if end is None:
            return scan
        pos = skip_ws(text, end)
        if pos >= len(text):
            return scan
        if text[pos] == "}":
            scan.state, scan.end = Scan.COMPLETE, pos + 1
            return scan
        if text[pos] != ",":
            return ObjectScan(Scan.INVALID)
        pos = skip_ws(text, pos + 1)
