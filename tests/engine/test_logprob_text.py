"""Logprob token texts and bytes in context (issue 13 items 3 and 4), with real tokenizers:
the OutputProcessor fed engine-core outputs of chosen tokens, then the server's formatting."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.engine.logprob_text import LogprobBytes, LogprobDetokenizer, first_token_text
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.entrypoints.openai.serving_logprobs import chat_logprobs, completion_logprobs
from pagedserve.messages import EngineCoreOutput, PromptLogprobsData, SampleLogprobsData
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

_SHARED = Path(__file__).resolve().parents[3] / "shared"
TOKENIZERS = {
    "gpt2": _SHARED / "tokenizers/gpt2",
    "llama3": _SHARED / "tokenizers/llama3",
    "qwen3": _SHARED / "tokenizers/qwen3",
    "sentencepiece-32k": _SHARED / "tokenizers/sentencepiece-32k",  # byte fallback <0xNN>
    "stories260k": _SHARED / "models/stories260k",  # 512 pieces: most characters as <0xNN>
}
TEXTS = [" there was a little girl", "你好，世界！", " 🎉👍🏽 done", "Café — 🇫🇷"]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerBase]:
    return {name: AutoTokenizer.from_pretrained(path) for name, path in TOKENIZERS.items()}


def _continuation(tokenizer: PreTrainedTokenizerBase, prompt: str, text: str) -> list[int]:
    """Token ids of `text` as the model would produce it after `prompt` (in context)."""
    prompt_ids, full = tokenizer.encode(prompt), tokenizer.encode(prompt + text)
    assert full[: len(prompt_ids)] == prompt_ids
    return list(full[len(prompt_ids) :])


def _generate(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    output_ids: list[int],
    alternatives: list[int],
    **params: object,
) -> RequestOutput:
    """Run `output_ids` through an OutputProcessor as if sampled, each position offering
    `alternatives` as its top-k; returns the final RequestOutput."""
    sampling = SamplingParams(
        max_tokens=len(output_ids), logprobs=len(alternatives), ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY, **params,  # type: ignore[arg-type]
    )  # fmt: skip
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, prompt_ids, sampling, ["r"])
    if sampling.prompt_logprobs is not None:
        rows = list(range(1, len(prompt_ids)))
        data = PromptLogprobsData(
            1,
            [[prompt_ids[i], *alternatives] for i in rows],
            [[-1.0] * (1 + len(alternatives)) for _ in rows],
            [1 + len(alternatives)] * len(rows),
        )
        processor.process_outputs([EngineCoreOutput("r", [], None, None, None, 0, data)])
    finals = []
    for i, token_id in enumerate(output_ids):
        # The sampled token ranks after the alternatives (top-k).
        rank = 1 + len(alternatives)
        logprobs = SampleLogprobsData([token_id, *alternatives], [-2.0] + [-0.5] * (rank - 1), rank)
        finish = "length" if i == len(output_ids) - 1 else None
        output = EngineCoreOutput("r", [token_id], logprobs, finish, None, 0)
        finals, _ = processor.process_outputs([output])
    return finals[0]


def test_stories260k_tokens_keep_their_spaces(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    """The issue's case: ", there was a little girl" after "Once upon a time"."""
    tokenizer = tokenizers["stories260k"]
    prompt_ids = tokenizer.encode("Once upon a time")
    output_ids = _continuation(tokenizer, "Once upon a time", ", there was a little girl")
    there = tokenizer.convert_tokens_to_ids("▁there")
    output = _generate(tokenizer, prompt_ids, output_ids, [there], prompt_logprobs=1)
    completion = output.outputs[0]
    tokens = [
        entry[t].decoded_token
        for t, entry in zip(completion.token_ids, completion.logprobs or [], strict=True)
    ]
    assert tokens == [",", " there", " was", " a", " little", " g", "ir", "l"]
    assert "".join(tokens) == completion.text == ", there was a little girl"
    # Alternatives are spelled at the sampled token's position: "▁there" as " there".
    assert all(entry[there].decoded_token == " there" for entry in completion.logprobs or [])
    # Prompt logprobs: "<s>" has no entry, and "▁Once" starts the text.
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    prompt_tokens = [
        entry[t].decoded_token
        for t, entry in zip(prompt_ids[1:], output.prompt_logprobs[1:], strict=True)
    ]  # type: ignore[index]
    assert prompt_tokens == ["Once", " upon", " a", " time"]
    assert first_token_text(tokenizer, prompt_ids[0]) == ""  # <s>, skipped as in the text
    assert first_token_text(tokenizer, prompt_ids[0], skip_special_tokens=False) == "<s>"


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("text", TEXTS)
def test_token_texts_join_and_bytes_concatenate_to_the_text(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str, text: str
) -> None:
    tokenizer = tokenizers[name]
    prompt_ids = tokenizer.encode("Once upon a time")
    output_ids = _continuation(tokenizer, "Once upon a time", text)
    # Alternatives: a token holding the first bytes of a character where the vocabulary has one.
    first_byte = tokenizer.encode("🎉", add_special_tokens=False)[:1]
    output = _generate(tokenizer, prompt_ids, output_ids, first_byte)
    completion = output.outputs[0]
    logprobs = completion.logprobs or []
    tokens = [
        entry[t].decoded_token for t, entry in zip(completion.token_ids, logprobs, strict=True)
    ]
    assert "".join(tokens) == completion.text  # type: ignore[arg-type]
    content = chat_logprobs(completion.token_ids, logprobs, 1, LogprobBytes(tokenizer))
    joined = b"".join(bytes(c.bytes or []) for c in content)
    assert joined.decode() == completion.text
    assert "\ufffd" not in completion.text or "\ufffd" in text
    if "\ufffd" not in text:
        assert all(b"\xef\xbf\xbd" not in bytes(c.bytes or []) for c in content)
    # An alternative that would end inside a character: its text is "", its bytes its own.
    if first_byte != output_ids[:1] and "\ufffd" in tokenizer.decode(first_byte):
        first = content[0].top_logprobs[0]
        assert (
            first.token == ""
            and first.bytes
            and bytes(first.bytes) == "🎉".encode()[: len(first.bytes)]
        )


def test_partial_character_bytes_are_raw(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    """Issue 13 item 4: a byte-level token holding part of a character is not EF BF BD."""
    tokenizer = tokenizers["llama3"]
    output_ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(output_ids) >= 2  # the emoji's bytes are split over tokens
    output = _generate(tokenizer, tokenizer.encode("Hi"), output_ids, [])
    completion = output.outputs[0]
    content = chat_logprobs(
        completion.token_ids, completion.logprobs or [], 0, LogprobBytes(tokenizer)
    )
    assert [c.token for c in content][:-1] == [""] * (len(output_ids) - 1)
    assert content[-1].token == "🎉" == completion.text
    assert b"".join(bytes(c.bytes or []) for c in content) == "🎉".encode()
    assert bytes(content[0].bytes or []) == "🎉".encode()[: len(content[0].bytes or [])] != b""


def test_unfinished_character_ends_the_last_token(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    """Bytes of a character that never completes show as U+FFFD at the end of the text, and
    of the last token's text."""
    tokenizer = tokenizers["llama3"]
    first = tokenizer.encode("🎉", add_special_tokens=False)[:1]
    hello = tokenizer.encode(" hello", add_special_tokens=False)
    output = _generate(tokenizer, tokenizer.encode("Hi"), hello + first, [])
    completion = output.outputs[0]
    tokens = [
        e[t].decoded_token
        for t, e in zip(completion.token_ids, completion.logprobs or [], strict=True)
    ]
    assert completion.text == " hello\ufffd" == "".join(tokens)  # type: ignore[arg-type]


def test_echoed_tokens_and_text_offset(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    """Completions with echo: the prompt's token texts join to the echoed prompt, and
    text_offset indexes the returned text (no "<s>" counted)."""
    tokenizer = tokenizers["stories260k"]
    prompt_ids = tokenizer.encode("Once upon a time")
    output_ids = _continuation(tokenizer, "Once upon a time", ", there")
    output = _generate(tokenizer, prompt_ids, output_ids, [], prompt_logprobs=0)
    completion = output.outputs[0]
    echoed, offset = completion_logprobs(
        prompt_ids, output.prompt_logprobs, 0, lambda t: first_token_text(tokenizer, t), 0
    )
    generated, end = completion_logprobs(
        completion.token_ids, completion.logprobs, 0, lambda t: "unused", offset
    )
    tokens = echoed.tokens + generated.tokens
    text = "Once upon a time" + completion.text
    assert tokens == ["", "Once", " upon", " a", " time", ",", " there"]
    assert "".join(tokens) == text and end == len(text)
    offsets = echoed.text_offset + generated.text_offset
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert [text[o : o + len(t)] for o, t in zip(offsets, tokens, strict=True)] == tokens


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_peek_is_what_the_token_would_add(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str, skip_special_tokens: bool
) -> None:
    """An alternative is spelled exactly as it would have been, had it been sampled there,
    except a special token that skip_special_tokens drops: spelled by its own text, not ""."""
    tokenizer = tokenizers[name]
    ids = tokenizer.encode("Once upon a time 你好 🎉 done") + [tokenizer.eos_token_id]
    decoder = LogprobDetokenizer(tokenizer, ids[:2], skip_special_tokens=skip_special_tokens)
    texts = []
    for token_id in ids[2:]:
        peeked = decoder.peek(token_id)
        texts.append(decoder.advance(token_id))
        if skip_special_tokens and token_id == tokenizer.eos_token_id:
            assert texts[-1] == "" and peeked == tokenizer.convert_ids_to_tokens(token_id)
        else:
            assert peeked == texts[-1]
    assert ("</s>" in "".join(texts) or "<|" in "".join(texts)) != skip_special_tokens


def test_special_alternatives_keep_their_names(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    """Special tokens among the alternatives are spelled by their text ("<s>", "</s>"), not
    the "" that skip_special_tokens gives them when sampled: completions' top_logprobs (keyed
    by text) keeps both, where "" would have merged them into one entry."""
    from pagedserve.engine.logprob_text import logprob_entry

    tokenizer = tokenizers["stories260k"]
    word = tokenizer.encode("Once", add_special_tokens=False)[0]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    decoder = LogprobDetokenizer(tokenizer, tokenizer.encode("Hi"))
    entry = logprob_entry([word, bos, eos], [-0.1, -2.0, -3.0], 1, decoder)
    assert [entry[t].decoded_token for t in (bos, eos)] == ["<s>", "</s>"]
    logprobs, _ = completion_logprobs([word], [entry], 2, lambda _: "", 0)
    assert logprobs.top_logprobs[0] is not None and len(logprobs.top_logprobs[0]) == 3
