"""Benchmark workloads as vLLM's `--dataset-name random|sharegpt` makes them (token counts)."""

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHAREGPT_FORMAT = (
    'ShareGPT JSON: a list of {"conversations": [{"from": "human", "value": ...}, '
    '{"from": "gpt", "value": ...}]}'
)
# vLLM's ShareGPT filter: prompts and replies of at least 4 tokens, prompts of at most 1024
# tokens and conversations of at most 2048 (the reply's limit is off with --sharegpt-output-len).
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


class DatasetError(ValueError):
    """A workload that cannot be built (a dataset file that cannot be read or parsed, no
    tokenizer to count with); the message is one line for the user."""


@dataclass
class SampleRequest:
    """One benchmark request: its prompt (text, or token ids sent as they are), the prompt's
    length in tokens and how many tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's dataset flags (`--dataset-name`, `--random-*`, `--sharegpt-output-len`)."""
    group = parser.add_argument_group("dataset options")
    group.add_argument(
        "--dataset-name",
        choices=("random", "sharegpt"),
        default="random",
        help="random token prompts, or a ShareGPT file (--dataset-path)",
    )
    group.add_argument("--dataset-path", default=None, help=f"the dataset file ({SHAREGPT_FORMAT})")
    group.add_argument("--num-prompts", type=int, default=1000, help="requests to run")
    group.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    group.add_argument("--random-output-len", type=int, default=128, help="output tokens")
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (default: fixed)",
    )
    group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="random tokens before every random prompt (the same for all)",
    )
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output tokens of every ShareGPT request (default: the reply's)",
    )


def length_bounds(length: int, range_ratio: float, low_at_least: int = 0) -> tuple[int, int]:
    """vLLM's sampling interval of a random length: [floor(len (1 - r)), ceil(len (1 + r))],
    the low end raised to `low_at_least` (1 for outputs) and the high end to match."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(math.floor(length * (1 - range_ratio)), low_at_least)
    return low, max(math.ceil(length * (1 + range_ratio)), low)


def random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    prefix_len: int = 0,
    tokenizer: Any = None,
) -> list[SampleRequest]:
    """vLLM's random dataset: prompt i is `prefix + (offset_i + i + arange(len_i)) % vocab`,
    lengths uniform within `length_bounds`. Token-id prompts (exact lengths), or their decoded
    text when `tokenizer` is given (for chat endpoints; the length is then the text's)."""
    rng = np.random.default_rng(seed)
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio, low_at_least=1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    requests = []
    for i in range(num_requests):
        ids = prefix + ((offsets[i] + i + np.arange(input_lens[i])) % vocab_size).tolist()
        prompt: str | list[int] = ids
        prompt_len = len(ids)
        if tokenizer is not None:
            prompt = tokenizer.decode(ids)
            prompt_len = len(tokenizer(prompt).input_ids)
        requests.append(SampleRequest(prompt, prompt_len, int(output_lens[i])))
    return requests


def read_sharegpt(path: str) -> list[tuple[str, str]]:
    """The (first human turn, the gpt reply after it) pairs of a ShareGPT file; conversations
    with no reply are left out. Raises DatasetError naming the file and the format."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else f"not JSON: {e}"
        raise DatasetError(f"cannot read {path} ({reason}); expected {SHAREGPT_FORMAT}") from None
    if not isinstance(data, list) or not all(_is_conversation(entry) for entry in data):
        raise DatasetError(f"{path} is not a ShareGPT file; expected {SHAREGPT_FORMAT}")
    pairs = [pair for entry in data if (pair := _first_exchange(entry["conversations"]))]
    if not pairs:
        raise DatasetError(f"{path} has no human turn with a gpt reply; expected {SHAREGPT_FORMAT}")
    return pairs


def _is_conversation(entry: Any) -> bool:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    return isinstance(turns, list) and all(
        isinstance(turn, dict) and isinstance(turn.get("value"), str) for turn in turns
    )


def _first_exchange(turns: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The first human turn and the gpt turn after it (turns 0 and 1 without "from" keys)."""
    if not any("from" in turn for turn in turns):
        return (turns[0]["value"], turns[1]["value"]) if len(turns) >= 2 else None
    for i, turn in enumerate(turns):
        if turn.get("from") == "human":
            replies = [t["value"] for t in turns[i + 1 :] if t.get("from") == "gpt"]
            return (turn["value"], replies[0]) if replies else None
    return None


def sharegpt_requests(
    pairs: list[tuple[str, str]],
    num_requests: int,
    tokenizer: Any,
    seed: int,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffled with `seed`; the output length is the reply's token
    count (or `output_len`); pairs outside vLLM's length filter are skipped; too few usable
    pairs are repeated (sampled with the same seed) up to `num_requests`."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    requests: list[SampleRequest] = []
    for prompt, reply in order:
        if len(requests) == num_requests:
            break
        prompt_len = len(tokenizer(prompt).input_ids)
        reply_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        too_short = prompt_len < SHAREGPT_MIN_LEN or (
            output_len is None and reply_len < SHAREGPT_MIN_LEN
        )
        too_long = (
            prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_LEN
        )
        if not too_short and not too_long:
            requests.append(SampleRequest(prompt, prompt_len, reply_len))
    if not requests:
        raise DatasetError(
            f"no ShareGPT conversation fits vLLM's length filter (prompt and reply of "
            f">= {SHAREGPT_MIN_LEN} tokens, prompt <= {SHAREGPT_MAX_PROMPT_LEN}, "
            f"both <= {SHAREGPT_MAX_TOTAL_LEN})"
        )
    if len(requests) < num_requests:
        requests += random.Random(seed).choices(requests, k=num_requests - len(requests))
    return requests


def check_dataset_args(args: argparse.Namespace) -> None:
    """Raise DatasetError naming a count flag out of its range (numpy's traceback, or a run
    of nothing, before)."""
    for flag, value, least in (
        ("--num-prompts", args.num_prompts, 1),
        ("--random-input-len", args.random_input_len, 0),
        ("--random-output-len", args.random_output_len, 1),
        ("--random-prefix-len", args.random_prefix_len, 0),
        ("--sharegpt-output-len", args.sharegpt_output_len, 1),
    ):
        if value is not None and value < least:
            raise DatasetError(f"{flag} must be at least {least}, got {value}")
    if args.dataset_name == "random" and args.random_input_len + args.random_prefix_len < 1:
        raise DatasetError("--random-input-len + --random-prefix-len must be at least 1")


def sample_requests(
    args: argparse.Namespace, vocab_size: int, tokenizer: Any, text_prompts: bool = False
) -> list[SampleRequest]:
    """The requests `add_dataset_args`' flags ask for (a ShareGPT file already checked with
    `read_sharegpt` is read again here; it is small next to the run)."""
    check_dataset_args(args)
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise DatasetError("--dataset-name sharegpt needs --dataset-path FILE")
        if tokenizer is None:
            raise DatasetError("--dataset-name sharegpt needs a tokenizer to count tokens")
        pairs = read_sharegpt(args.dataset_path)
        return sharegpt_requests(
            pairs, args.num_prompts, tokenizer, args.seed, args.sharegpt_output_len
        )
    return random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        vocab_size,
        args.seed,
        args.random_prefix_len,
        tokenizer if text_prompts else None,
    )
