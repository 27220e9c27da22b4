"""Options declared once, on dataclass fields (`pagedserve.config_options.option`), rendered as
argparse flags and as Markdown tables for the docs.

A field `max_model_len` becomes the flag `--max-model-len` (vLLM's spelling) with the field's
default and help; a bool becomes `--flag/--no-flag` (argparse.BooleanOptionalAction) unless the
field's `cli` says otherwise (e.g. `{"action": "store_true"}`); the type comes from the
annotation (`int | None` -> int). Import rule: only `pagedserve.config_options`
and `pagedserve.entrypoints.argv`.
"""

import argparse
import dataclasses
import typing
from typing import Any

from pagedserve.config_options import is_option, option_default
from pagedserve.entrypoints.argv import human_int

MARKER = "<!-- {name}:{end} -->"


def flag_name(name: str) -> str:
    """`--max-model-len` for the field `max_model_len`."""
    return "--" + name.replace("_", "-")


def _value_type(annotation: Any) -> Any:
    """The type a flag's text converts to: the annotation without None (`int | None` -> int),
    and the item type of a list (`list[str]` -> str)."""
    kinds = [k for k in typing.get_args(annotation) or (annotation,) if k is not type(None)]
    kind = kinds[0]
    if typing.get_origin(kind) is list:
        return typing.get_args(kind)[0]
    return kind


def _is_store_true(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata["cli"].get("action") == "store_true")


def flag_help(f: dataclasses.Field[Any]) -> str:
    """The option's help with its default, as `--help` shows it (argparse %-formatting)."""
    text = f.metadata["help"].replace("%", "%%")
    if _is_store_true(f):  # off unless given: nothing to say about a default
        return str(text)
    default_text = f.metadata["default_text"]
    shown = default_text.replace("%", "%%") if default_text else "%(default)s"
    return f"{text} (default: {shown})"


def argparse_kwargs(f: dataclasses.Field[Any]) -> dict[str, Any]:
    """`add_argument` keywords of an option field: default, help, and type or action."""
    kwargs: dict[str, Any] = {"default": option_default(f), "help": flag_help(f)}
    cli = f.metadata["cli"]
    if "action" not in cli:
        kind = _value_type(f.type)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is int:  # "32k", "4GiB" as vLLM's human_readable_int takes them
            kwargs["type"] = human_int
        else:
            kwargs["type"] = kind
    kwargs.update(cli)
    kwargs.pop("aliases", None)
    return kwargs


def option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of a dataclass declared with `option(...)`, in their order."""
    return [f for f in dataclasses.fields(cls) if is_option(f)]


def add_options(parser: Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per option field of dataclass `cls` (but those named in `skip`) to an
    argparse parser or argument group."""
    for f in option_fields(cls):
        if f.name not in skip:
            aliases = f.metadata["cli"].get("aliases", ())  # vLLM's short forms, e.g. -tp
            parser.add_argument(flag_name(f.name), *aliases, **argparse_kwargs(f))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(cls: type, keyword_column: bool) -> str:
    """A Markdown table of the option fields of dataclass `cls`: (Python keyword,) flag,
    default, meaning. Without a trailing newline."""
    head = ["option"] if keyword_column else []
    rows = ["| " + " | ".join([*head, "flag", "default", "meaning"]) + " |"]
    rows.append("|" + "---|" * (len(head) + 3))
    for f in option_fields(cls):
        names = (flag_name(f.name), *f.metadata["cli"].get("aliases", ()))
        flag = ", ".join(f"`{name}`" for name in names)
        if argparse_kwargs(f).get("action") is argparse.BooleanOptionalAction:
            flag += f", `--no-{flag_name(f.name)[2:]}`"
        default_text = f.metadata["default_text"]
        if default_text:
            default = default_text
        elif _is_store_true(f):
            default = "off"
        else:
            default = f"`{option_default(f)}`"
        cells = [f"`{f.name}`"] if keyword_column else []
        meaning = f.metadata["help"]
        if "choices" in f.metadata["cli"]:
            meaning += f" (one of {', '.join(map(str, f.metadata['cli']['choices']))})"
        cells += [flag, default, meaning]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def marked_region(text: str, name: str) -> str:
    """What lies between `<!-- NAME:begin -->` and `<!-- NAME:end -->` lines of a Markdown
    text, without the newlines next to the markers. Raises ValueError if a marker is missing."""
    begin = MARKER.format(name=name, end="begin")
    end = MARKER.format(name=name, end="end")
    if begin not in text or end not in text:
        raise ValueError(f"markers {begin} ... {end} not found")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")
