"""The command line as vLLM users type it: underscore spellings of flags, human-readable sizes,
and flags from a YAML file (`--config FILE`).

Source: vLLM's `FlexibleArgumentParser` (vllm/utils/argparse_utils.py) and
`human_readable_int`: `--max_num_seqs=12` is `--max-num-seqs=12`; `32k` is 32,000 and `32K`
32,768; `--config FILE.yaml` holds `flag-name: value` pairs that the command line overrides.
"""

import argparse
import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

# Decimal (lower case) and binary (upper case) multipliers, as vLLM's human_readable_int;
# byte units (kB/KiB, MB/MiB, ...) too, for the options that count bytes.
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_BYTE_UNITS = {
    **{f"{p}b": m for p, m in _DECIMAL.items()},
    **{f"{p.upper()}B": m for p, m in _DECIMAL.items()},
    **{f"{p}iB": m for p, m in _BINARY.items()},
    **{f"{p}ib": m for p, m in _BINARY.items()},
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def human_int(text: str) -> int:
    """argparse type of an integer option that may carry a size suffix: "32768", "32k"
    (32,000), "32K" (32,768), "25.6k" (25,600), "4GiB" (4 * 2**30), "4GB" (4 * 10**9).

    A fraction is allowed with a suffix when the result is whole; it is computed exactly
    (fractions.Fraction: "9007199254740.993k" is 9,007,199,254,740,993, and "1.0000001k" is
    not whole). Raises argparse.ArgumentTypeError naming the accepted forms."""
    match = _SIZE.fullmatch(text)
    reason = ""
    if match is None and re.fullmatch(r"\s*-\d+\s*", text):
        return int(text)  # a negative plain integer (e.g. -1 meaning "no cap")
    if match is not None:
        number, suffix = match.groups()
        scale = 1 if not suffix else _DECIMAL.get(suffix) or _BINARY.get(suffix)
        scale = scale or _BYTE_UNITS.get(suffix)
        if scale is not None and ("." not in number or suffix):
            value = Fraction(number) * scale
            if value.denominator == 1:
                return int(value)
            reason = f"{number} x {scale} = {value} is not a whole number; "
    raise argparse.ArgumentTypeError(
        f"invalid integer {text!r}: {reason}want digits with an optional size suffix "
        f"(k/m/g/t = 1000^n, K/M/G/T = 1024^n, or kB/MB/GB, KiB/MiB/GiB)"
    )


def normalize_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (for `parser`) with `--config FILE` replaced by the flags its YAML holds (placed
    first, so that the command line wins) and underscores in long flag names turned into
    dashes.

    The file's flags go after the subcommand and its positional model, if the command line
    has one (as vLLM's `serve MODEL --config FILE`), so that a list value for a flag taking
    several values cannot swallow the model. Raises SystemExit with one line naming the file
    when it cannot be read or is not a mapping of flag names to values."""
    out: list[str] = []
    from_file: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
            if name.replace("_", "-") == "--config":
                if not eq:
                    if i + 1 >= len(argv):
                        raise SystemExit("pagedserve: error: --config needs a YAML file")
                    i += 1
                    value = argv[i]
                from_file += config_file_flags(value, option_actions(parser))
                i += 1
                continue
        out.append(arg)
        i += 1
    # The file's flags go right after the subcommand and its positional (or first), before
    # the command line's flags.
    split = 0
    while split < len(out) and split < 2 and not out[split].startswith("-"):
        split += 1
    return out[:split] + from_file + out[split:]


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of `parser` and of its subcommands' parsers, with its action."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for name in action.option_strings:
            found.setdefault(name, action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for name, sub_action in option_actions(sub).items():
                    found.setdefault(name, sub_action)
    return found


def _takes_several(action: argparse.Action | None) -> bool:
    """Whether a flag takes several command-line values (nargs "+", "*" or a count > 1)."""
    nargs = None if action is None else action.nargs
    return nargs in ("+", "*") or (isinstance(nargs, int) and nargs > 1)


def _text(value: Any) -> str:
    """A YAML scalar as a command-line value; a list or mapping as its JSON."""
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def config_file_flags(path: str, actions: dict[str, argparse.Action]) -> list[str]:
    """The flags a YAML config file stands for (`actions`: the parser's option strings with
    their actions): `max-num-seqs: 12` -> ["--max-num-seqs", "12"]; `true` -> the bare flag;
    `false` -> `--no-flag` where the parser has it, else nothing (an off switch left off);
    `null` -> nothing (the default stays); a list -> the flag followed by each item for a
    flag taking several values (`served-model-name: [a, b]`), else its JSON as one value
    (`allowed-origins: [...]`, a JSON-valued flag); a mapping -> its JSON. Raises SystemExit
    with one line on a bad file."""
    import yaml

    try:
        data: Any = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        message = f"pagedserve: error: --config {path}: cannot read it as YAML ({e})"
        raise SystemExit(message) from None
    if data is None:
        return []
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise SystemExit(
            f"pagedserve: error: --config {path}: want a YAML mapping of flag names to values "
            f"(e.g. `max-num-seqs: 12`), got {type(data).__name__}"
        )
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + key.lstrip("-").replace("_", "-")
        if value is None:
            continue
        if value is True:
            flags.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in actions:
                flags.append("--no-" + flag[2:])
        elif isinstance(value, list) and _takes_several(actions.get(flag)):
            if value:  # an empty list leaves the default
                flags += [flag, *map(_text, value)]
        else:
            flags += [flag, _text(value)]
    return flags
