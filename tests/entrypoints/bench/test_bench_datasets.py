"""`bench`'s datasets: vLLM's random lengths within the range ratio, ShareGPT parsing, and
one-line errors for dataset files that cannot be read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.llm_engine import load_tokenizer
from pagedserve.entrypoints.bench.datasets import (
    DatasetError,
    length_bounds,
    random_requests,
    read_sharegpt,
    sharegpt_requests,
)
from pagedserve.entrypoints.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]
CONVERSATIONS = [
    {"conversations": [
        {"from": "human", "value": "Once upon a time there was a little girl named Lily."},
        {"from": "gpt", "value": "She liked to play in the park with her big red ball."},
    ]},
    {"conversations": [  # a system turn first; the reply is the gpt turn after the human one
        {"from": "system", "value": "You tell stories."},
        {"from": "human", "value": "Tell me about a dog who found a bone in the garden."},
        {"from": "gpt", "value": "The dog was happy. He ran home to show his friend the cat."},
        {"from": "human", "value": "And then?"},
    ]},
    {"conversations": [{"from": "human", "value": "A question with no answer at all here."}]},
]  # fmt: skip


def test_length_bounds_are_vllms() -> None:
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(10, 0.33) == (6, 14)  # floor low, ceil high
    assert length_bounds(1, 0.5, low_at_least=1) == (1, 2)  # outputs: never 0 tokens
    assert length_bounds(7, 0.0) == (7, 7)
    for ratio in (1.0, -0.1):
        with pytest.raises(DatasetError, match="range-ratio"):
            length_bounds(10, ratio)


def test_random_lengths_obey_the_range_ratio() -> None:
    requests = random_requests(60, 40, 10, 0.5, vocab_size=512, seed=3)
    assert len(requests) == 60
    in_lens = [r.prompt_len for r in requests]
    out_lens = [r.expected_output_len for r in requests]
    assert all(20 <= n <= 60 for n in in_lens) and all(5 <= n <= 15 for n in out_lens)
    assert len(set(in_lens)) > 5 and len(set(out_lens)) > 3  # spread over the interval
    for r in requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert all(0 <= t < 512 for t in r.prompt)
    again = random_requests(60, 40, 10, 0.5, vocab_size=512, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in requests]  # the seed fixes them
    fixed = random_requests(5, 16, 4, 0.0, vocab_size=512, seed=0, prefix_len=3)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(19, 4)}
    assert len({tuple(r.prompt[:3]) for r in fixed}) == 1  # one shared prefix


def test_random_text_prompts_count_their_tokens() -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    for r in random_requests(3, 12, 4, 0.0, tokenizer.vocab_size, seed=1, tokenizer=tokenizer):
        assert isinstance(r.prompt, str)
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids)


def test_sharegpt_file_parses(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    pairs = read_sharegpt(str(path))
    first, second = (entry["conversations"] for entry in CONVERSATIONS[:2])
    assert pairs == [
        (first[0]["value"], first[1]["value"]),
        (second[1]["value"], second[2]["value"]),  # the system turn is not the prompt
    ]
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    requests = sharegpt_requests(pairs, 5, tokenizer, seed=0)
    assert len(requests) == 5  # two conversations, sampled again up to 5
    by_prompt = {prompt: reply for prompt, reply in pairs}
    for r in requests:
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids)
        assert r.expected_output_len == len(tokenizer(by_prompt[r.prompt]).input_ids)
    fixed = sharegpt_requests(pairs, 2, tokenizer, seed=0, output_len=3)
    assert sorted(r.prompt for r in fixed) == sorted(by_prompt) and {
        r.expected_output_len for r in fixed
    } == {3}


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "cannot read"),  # no such file
        ("{not json", "not JSON"),
        (json.dumps({"conversations": []}), "is not a ShareGPT file"),
        (json.dumps([{"conversations": [{"from": "human"}]}]), "is not a ShareGPT file"),
        (json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]), "no human turn"),
    ],
)
def test_a_bad_dataset_file_is_one_line(tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "throughput", "--dataset-name", "sharegpt",
                  "--dataset-path", str(path), "--device", "cpu"])  # fmt: skip
    message = str(exit_info.value.code)
    assert message.startswith("pagedserve bench throughput: error: ") and "\n" not in message
    assert words in message and str(path) in message and "ShareGPT JSON" in message


def test_a_bad_dataset_file_exits_with_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("[1, 2")
    command = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
               "--dataset-name", "sharegpt", "--dataset-path", str(path)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines == [lines[0]] and "Traceback" not in done.stderr
    assert str(path) in lines[0] and "ShareGPT JSON" in lines[0]
