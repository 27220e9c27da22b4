"""Validation helpers of the request parameters (SamplingParams, BeamSearchParams): a
torch-free leaf."""

from typing import Any

from pagedserve.errors import InvalidRequestError


def is_int(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_unicode(text: str) -> bool:
    """False for a string the tokenizer cannot take: a lone surrogate ("\\ud800" in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check(ok: bool, name: str, message: str, owner: str = "SamplingParams") -> None:
    """Raise InvalidRequestError "{owner}.{name} {message}", with `param` = name, unless `ok`."""
    if not ok:
        raise InvalidRequestError(f"{owner}.{name} {message}", name)
