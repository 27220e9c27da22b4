"""/v1/completions and /v1/models with the official openai client: in process on the fake
engine (the real tokenizing, detokenizing and stop strings; a script for the model), and 64
concurrent streaming clients of the real server process."""

import asyncio
from typing import Any

import pytest

# Chinese and emoji: multi-byte characters split over several byte-level tokens.
PROMPTS = ["你好，世界！今天天气", "Emoji time 🎉🚀 and 🤖", "Once upon a time", "数学 ∑ π ≈ 3.14"]
GREEDY = {"temperature": 0.0}
FIXED_LENGTH = {"ignore_eos": True}


def stream_text(client: Any, **kwargs: Any) -> tuple[dict[int, str], list[Any]]:
    """Concatenated text per choice index, and all chunks."""
    texts: dict[int, str] = {}
    chunks = list(client.completions.create(stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, chunks


def test_models_lists_the_served_model(fake_app: Any) -> None:
    models = fake_app.client().models.list().data
    assert [m.id for m in models] == [fake_app.model]
    assert models[0].model_extra["max_model_len"] == 1024


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_equals_non_streamed(fake_app: Any, prompt: str) -> None:
    client = fake_app.client()
    args = dict(model=fake_app.model, prompt=prompt, max_tokens=24, extra_body=FIXED_LENGTH)
    full = client.completions.create(**args, **GREEDY)
    streamed, chunks = stream_text(client, **args, **GREEDY)
    assert streamed == {0: full.choices[0].text}
    assert full.choices[0].text  # random tokens of a 128k vocabulary always show something
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_include_usage_sends_one_final_usage_chunk(fake_app: Any) -> None:
    client = fake_app.client()
    num_prompt_tokens = len(fake_app.tokenize(prompt=PROMPTS[0]))
    chunks = list(
        client.completions.create(
            model=fake_app.model, prompt=PROMPTS[0], max_tokens=9, stream=True,
            stream_options={"include_usage": True}, extra_body=FIXED_LENGTH, **GREEDY,
        )
    )  # fmt: skip
    with_usage = [chunk for chunk in chunks if chunk.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt_tokens, 9)
    assert usage.total_tokens == num_prompt_tokens + 9
    full = client.completions.create(
        model=fake_app.model, prompt=PROMPTS[0], max_tokens=9, extra_body=FIXED_LENGTH, **GREEDY
    )
    assert full.usage.prompt_tokens == num_prompt_tokens
    assert full.usage.completion_tokens == 9


def test_without_include_usage_no_chunk_has_usage(fake_app: Any, sse: Any) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True, **GREEDY}
    events = sse(fake_app.post("/v1/completions", body).text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in event for event in events[:-1])


def test_n_returns_indexed_choices(fake_app: Any) -> None:
    client = fake_app.client()
    args = dict(
        model=fake_app.model, prompt="Hello", max_tokens=6, n=3, seed=7, temperature=1.0,
        extra_body=FIXED_LENGTH,
    )  # fmt: skip
    full = client.completions.create(**args)
    assert [choice.index for choice in full.choices] == [0, 1, 2]
    assert full.usage.completion_tokens == 3 * 6
    streamed, chunks = stream_text(client, **args)
    assert sorted(streamed) == [0, 1, 2]
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason is not None]
    assert sorted(finishes) == [0, 1, 2]  # each choice finishes exactly once
    assert streamed == {choice.index: choice.text for choice in full.choices}  # same seeds


def test_echo_with_logprobs_returns_prompt_tokens(fake_app: Any) -> None:
    prompt = "Echo 你好"
    prompt_ids = fake_app.tokenize(prompt=prompt)
    result = fake_app.client().completions.create(
        model=fake_app.model, prompt=prompt, max_tokens=5, echo=True, logprobs=2,
        extra_body=FIXED_LENGTH, **GREEDY,
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    num_prompt = len(prompt_ids)
    assert len(logprobs.tokens) == num_prompt + 5
    # Token texts in context: the texts of all tokens join to the echoed prompt and the
    # completion (issue 13 item 3).
    assert "".join(logprobs.tokens) == choice.text
    assert "".join(logprobs.tokens[:num_prompt]) == prompt
    offsets = [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    assert logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(isinstance(lp, float) for lp in logprobs.token_logprobs[1:num_prompt])
    assert all(isinstance(lp, float) and lp <= 0.0 for lp in logprobs.token_logprobs[num_prompt:])
    for top in logprobs.top_logprobs[num_prompt:]:
        assert 1 <= len(top) <= 3  # the sampled token and the top 2
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    # greedy: the sampled token is the most likely one
    for token, lp, top in zip(
        logprobs.tokens[num_prompt:], logprobs.token_logprobs[num_prompt:],
        logprobs.top_logprobs[num_prompt:], strict=True,
    ):  # fmt: skip
        assert top[token] == lp == max(top.values())


def test_prompt_forms(fake_app: Any) -> None:
    client = fake_app.client()
    ids = fake_app.tokenize(prompt="Once upon a time")
    args = dict(model=fake_app.model, max_tokens=4, extra_body=FIXED_LENGTH, **GREEDY)
    by_text = client.completions.create(prompt="Once upon a time", **args).choices[0].text
    by_ids = client.completions.create(prompt=ids, **args).choices[0].text
    assert by_ids == by_text
    several = client.completions.create(prompt=["Once upon a time", "Hello"], n=2, **args)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == by_text
    lists = client.completions.create(prompt=[ids, ids[:2]], **args)
    assert [c.index for c in lists.choices] == [0, 1] and lists.choices[0].text == by_text
    assert lists.usage.prompt_tokens == len(ids) + 2


def test_stop_string_ends_the_text(fake_app: Any) -> None:
    client = fake_app.client()
    args = dict(model=fake_app.model, prompt=PROMPTS[2], max_tokens=24, extra_body=FIXED_LENGTH)
    full = client.completions.create(**args, **GREEDY).choices[0].text
    stop = full[5:8]  # some text the model is known to produce
    stopped = client.completions.create(**args, stop=[stop], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop
    assert stopped.text == full[: full.index(stop)]
    streamed, _ = stream_text(client, **args, stop=[stop], **GREEDY)
    assert streamed == {0: stopped.text}


def test_max_tokens_defaults_to_16(fake_app: Any) -> None:
    body = {"model": fake_app.model, "prompt": "Hi", "ignore_eos": True}
    assert fake_app.post("/v1/completions", body).json()["usage"]["completion_tokens"] == 16


def concurrent_streaming_clients(server: Any, num_clients: int) -> Any:
    """A coroutine: `num_clients` streams at once through the async openai client, each
    checked against the whole answer to its prompt."""
    client = server.client()
    args = dict(model=server.model, max_tokens=8, extra_body=FIXED_LENGTH, **GREEDY)
    expected = {p: client.completions.create(prompt=p, **args).choices[0].text for p in PROMPTS}

    async def one(async_client: Any, prompt: str) -> None:
        text, usage, finish = "", None, None
        stream = await async_client.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **args
        )
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        assert text == expected[prompt]
        assert finish == "length" and usage.completion_tokens == 8

    async def main() -> None:
        async with server.async_client() as async_client:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_clients)]
            await asyncio.wait_for(asyncio.gather(*(one(async_client, p) for p in prompts)), 120)

    return main()


def test_64_concurrent_streaming_clients(server: Any) -> None:
    """The real server process: uvicorn, the engine core batching 64 requests."""
    asyncio.run(concurrent_streaming_clients(server, 64))


def test_concurrent_streams_through_the_async_openai_client(fake_app: Any) -> None:
    """In process: openai.AsyncOpenAI over httpx.ASGITransport, on the app's loop."""
    fake_app.run(concurrent_streaming_clients(fake_app, 16))


def test_sampling_extras_are_accepted(fake_app: Any) -> None:
    body = {
        "prompt": "Once upon a time", "max_tokens": 4, "presence_penalty": 0.5,
        "frequency_penalty": 0.5, "repetition_penalty": 1.2, "top_k": 5, "min_p": 0.1,
        "seed": 1, "min_tokens": 2, "stop_token_ids": [3], "logit_bias": {"100": -100},
        "skip_special_tokens": False, "include_stop_str_in_output": True, "user": "me",
    }  # fmt: skip
    response = fake_app.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 2
