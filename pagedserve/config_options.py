"""The `option(...)` dataclass field that declares a user-facing option once (its default, help
and argparse keywords) for the configs, `EngineArgs`, `ServerArgs`, the CLI flags and the docs'
option tables (entrypoints/options.py renders them). Import rule: a leaf; imports nothing from
pagedserve.
"""

import argparse
import dataclasses
import json
from typing import Any


def json_object(text: str) -> dict[str, Any]:
    """argparse type of a JSON object flag (`--hf-overrides '{"key": 1}'`)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_text: str | None = None,
    cli: dict[str, Any] | None = None,
) -> Any:
    """A dataclass field that is a user-facing option (vLLM's name), with its one default.

    help: what the option does, shown by `--help` and in the README's option table.
    default_text: what the default means, where its value alone does not say it (shown as
        "(default: TEXT)" instead of the value).
    cli: extra `argparse.add_argument` keywords (type, nargs, choices, action) where the
        field's annotation does not give them.
    Without `default`, the config holds a value derived when it is created (e.g. from the
    model's config.json); the option then defaults to None ("derive it"), the field is
    keyword-only, and `default_text` (required) says how it is derived.
    Returns a `dataclasses.field`; raises ValueError when `default_text` is missing there.
    """
    if default is dataclasses.MISSING and not default_text:
        raise ValueError("an option without a default needs default_text saying how it is derived")
    metadata = {"help": help, "default_text": default_text, "cli": cli or {}}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata, kw_only=True)
    return dataclasses.field(default=default, metadata=metadata)


def is_option(f: dataclasses.Field[Any]) -> bool:
    """Whether a dataclass field was declared with `option(...)`."""
    return "help" in f.metadata


def option_default(f: dataclasses.Field[Any]) -> Any:
    """The default of an option as the user sees it: the field's, or None where it is derived."""
    return None if f.default is dataclasses.MISSING else f.default
