"""Tests of IncrementalDetokenizer against one-shot decoding with real tokenizers.

What streamed text is compared with: the text the output adds to the prompt, i.e.
decode(prompt + output) minus decode(prompt), as vLLM streams it. For byte-level BPE this equals
decode(output); SentencePiece-style decoders strip the leading space of a text, so after a prompt
the first piece "▁Hello" streams as " Hello" where decode(output) alone gives "Hello".
"""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import IncrementalDetokenizer

_SHARED = Path(__file__).resolve().parents[3] / "shared"  # ../shared beside the checkout
TOKENIZER_PATHS = {
    "gpt2": _SHARED / "tokenizers/gpt2",
    "llama3": _SHARED / "tokenizers/llama3",
    "qwen3": _SHARED / "tokenizers/qwen3",
    "sentencepiece-32k": _SHARED / "tokenizers/sentencepiece-32k",
    "stories260k": _SHARED / "models/stories260k",
    "tinystories-656k": _SHARED / "models/tinystories-656k",
}
BYTE_LEVEL = {"gpt2", "llama3", "qwen3"}
ASCII_ONLY = {"tinystories-656k"}  # maps é, emoji and CJK to <unk>


TEXTS = [
    "Hello world, this is a test.\nNew line  with two spaces\n\n  and an indented line.",
    "你好，世界！今天天气很好。",
    "🎉👍🏽 family: 👨\u200d👩\u200d👧 and 🇫🇷 done",
    "Café naïve résumé — Ångström, déjà vu.",
]
PROMPTS = ["Once upon a time", ""]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerBase]:
    return {name: AutoTokenizer.from_pretrained(path) for name, path in TOKENIZER_PATHS.items()}


def _encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    return tokenizer.encode(prompt) if prompt else []  # with BOS where the tokenizer adds one


def _added_text(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    output_ids: list[int],
    skip_special_tokens: bool = True,
) -> str:
    """What `output_ids` add to the decoded prompt: the reference for streamed text."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


def _stream(detokenizer: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    """Feed the chunks one update each; the deltas returned after each, then at finish."""
    deltas = []
    for chunk in chunks:
        assert detokenizer.update(chunk) is None
        deltas.append(detokenizer.get_next_output_text(finished=False, delta=True))
    deltas.append(detokenizer.get_next_output_text(finished=True, delta=True))
    return deltas


def _split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, start = [], 0
    for size in sizes:
        if start >= len(ids):
            break
        chunks.append(ids[start : start + size])
        start += size
    if start < len(ids):
        chunks.append(ids[start:])
    return chunks


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("name", list(TOKENIZER_PATHS))
def test_streaming_one_token_at_a_time_matches_one_shot_decode(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str, text: str, prompt: str
) -> None:
    if name in ASCII_ONLY and not text.isascii():
        pytest.skip("characters outside the vocabulary decode to nothing (<unk>)")
    tokenizer = tokenizers[name]
    prompt_ids = _encode_prompt(tokenizer, prompt)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)

    deltas = _stream(detokenizer, [[token_id] for token_id in output_ids])

    expected = _added_text(tokenizer, prompt_ids, output_ids)
    assert "".join(deltas) == expected == detokenizer.output_text
    assert not any("\ufffd" in delta for delta in deltas)  # no half characters, ever
    if name in BYTE_LEVEL or not prompt_ids:
        assert expected == tokenizer.decode(output_ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["sentencepiece-32k", "stories260k", "tinystories-656k"])
def test_sentencepiece_first_piece_keeps_its_space_after_the_prompt(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str
) -> None:
    tokenizer = tokenizers[name]
    output_ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.decode(output_ids) == "Hello world"  # one-shot: leading space stripped
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Once upon a time"))
    assert "".join(_stream(detokenizer, [[i] for i in output_ids])) == " Hello world"


def test_character_split_over_byte_tokens_waits_until_complete(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    tokenizer = tokenizers["gpt2"]
    output_ids = tokenizer.encode(" ok 🎉")
    # " 🎉" is three tokens (" \xf0\x9f", "\x8e", "\x89"), none a whole character alone.
    assert [tokenizer.decode([i]) for i in output_ids[-3:]] == [" \ufffd", "\ufffd", "\ufffd"]
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say"))
    assert _stream(detokenizer, [[i] for i in output_ids]) == [" ok", "", "", " 🎉", ""]


def test_unfinished_character_is_released_as_replacement_char_at_finish(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    tokenizer = tokenizers["gpt2"]
    output_ids = tokenizer.encode(" ok 🎉")[:-1]  # the model stopped inside the emoji
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = _stream(detokenizer, [[i] for i in output_ids])
    assert deltas == [" ok", "", "", " \ufffd"]
    assert detokenizer.output_text == tokenizer.decode(output_ids) == " ok \ufffd"


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_byte_level_ids_stream_to_the_one_shot_decode(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str, data: st.DataObject
) -> None:
    tokenizer = tokenizers[name]
    special_ids = set(tokenizer.all_special_ids)
    token_id = st.integers(0, len(tokenizer) - 1).filter(lambda i: i not in special_ids)
    output_ids = data.draw(st.lists(token_id, min_size=1, max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=40))
    prompt_ids = data.draw(st.sampled_from([[], tokenizer.encode("Once upon a time")]))
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)

    deltas = _stream(detokenizer, _split(output_ids, sizes))

    expected = tokenizer.decode(output_ids, skip_special_tokens=True)
    assert "".join(deltas) == expected == detokenizer.output_text


@pytest.mark.parametrize("name", list(TOKENIZER_PATHS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_text_streams_to_what_it_adds_to_the_prompt(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str, data: st.DataObject
) -> None:
    tokenizer = tokenizers[name]
    pieces = st.sampled_from(list("ab z\n\t.'é中😀👍🏽\u200d€д") + ["</s>", "<s>", "▁", "<0x41>"])
    text = "".join(data.draw(st.lists(pieces, min_size=1, max_size=30)))
    prompt = data.draw(st.sampled_from(["Once upon a time", "", "end ", "中"]))
    skip_special_tokens = data.draw(st.booleans())
    prompt_ids = _encode_prompt(tokenizer, prompt)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    sizes = data.draw(st.lists(st.integers(1, 3), max_size=30))
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
    )

    deltas = _stream(detokenizer, _split(output_ids, sizes))

    expected = _added_text(tokenizer, prompt_ids, output_ids, skip_special_tokens)
    assert "".join(deltas) == expected
    assert not any("\ufffd" in delta for delta in deltas)


def test_window_stays_short_on_long_outputs(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    tokenizer = tokenizers["qwen3"]
    output_ids = tokenizer.encode(" ".join(TEXTS) * 20)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    for token_id in output_ids:
        detokenizer.update([token_id])
        # The cost per token is that of decoding the window (the last two emissions).
        assert len(detokenizer._window_ids) <= 8
    assert detokenizer.output_text == tokenizer.decode(output_ids)


# --- special tokens -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "special_id"),
    [
        ("gpt2", 50256),  # <|endoftext|>
        ("llama3", 128009),  # <|eot_id|>: special, though not in all_special_ids
        ("qwen3", 151645),  # <|im_end|>
        ("sentencepiece-32k", 2),  # </s>
        ("stories260k", 1),  # <s>: how this model ends a story
        ("tinystories-656k", 2),  # <|end_story|>
    ],
)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_dropped_or_kept(
    tokenizers: dict[str, PreTrainedTokenizerBase],
    name: str,
    special_id: int,
    skip_special_tokens: bool,
) -> None:
    tokenizer = tokenizers[name]
    prompt_ids = tokenizer.encode("Once upon a time")
    words = tokenizer.encode(" there was", add_special_tokens=False)
    output_ids = words + [special_id] + words + [special_id]
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
    )

    text = "".join(_stream(detokenizer, [[i] for i in output_ids]))

    assert text == _added_text(tokenizer, prompt_ids, output_ids, skip_special_tokens)
    special_text = tokenizer.convert_ids_to_tokens(special_id)
    assert (special_text in text) is not skip_special_tokens


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_stop_terminated_leaves_out_the_eos_text(
    tokenizers: dict[str, PreTrainedTokenizerBase], include_stop_str_in_output: bool
) -> None:
    tokenizer = tokenizers["gpt2"]
    detokenizer = IncrementalDetokenizer(
        tokenizer,
        [],
        skip_special_tokens=False,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    assert detokenizer.update(tokenizer.encode("Hi") + [50256], stop_terminated=True) is None
    expected = "Hi<|endoftext|>" if include_stop_str_in_output else "Hi"
    assert detokenizer.get_next_output_text(finished=True, delta=False) == expected


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A toy WordPiece tokenizer: its decoder puts a space between added tokens."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


@pytest.mark.parametrize(
    ("spaces_between_special_tokens", "expected"),
    [(True, "hello [SEP] [SEP] worlds"), (False, "hello [SEP][SEP] worlds")],
)
def test_spaces_between_special_tokens(spaces_between_special_tokens: bool, expected: str) -> None:
    tokenizer = _wordpiece_tokenizer()
    output_ids = [3, 2, 2, 4, 5]
    assert tokenizer.decode(output_ids, skip_special_tokens=False) == "hello [SEP] [SEP] worlds"
    detokenizer = IncrementalDetokenizer(
        tokenizer,
        [],
        skip_special_tokens=False,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
    assert "".join(_stream(detokenizer, [[i] for i in output_ids])) == expected


# --- stop strings ---------------------------------------------------------------------------


def _gpt2_detokenizer(
    tokenizers: dict[str, PreTrainedTokenizerBase],
    stop: list[str],
    include_stop_str_in_output: bool = False,
) -> tuple[IncrementalDetokenizer, PreTrainedTokenizerBase]:
    tokenizer = tokenizers["gpt2"]
    detokenizer = IncrementalDetokenizer(
        tokenizer,
        tokenizer.encode("Me:"),
        stop=stop,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    return detokenizer, tokenizer


def test_stop_string_spanning_two_tokens(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    detokenizer, tokenizer = _gpt2_detokenizer(tokenizers, stop=["lo wo"])
    hello, world, *_ = tokenizer.encode("Hello world, how are you?")  # "Hello", " world"
    assert detokenizer.update([hello]) is None
    assert detokenizer.update([world]) == "lo wo"
    assert detokenizer.output_text == "Hel"
    assert detokenizer.get_next_output_text(finished=True, delta=False) == "Hel"


@pytest.mark.parametrize(
    ("include_stop_str_in_output", "expected"), [(False, "Hello "), (True, "Hello wor")]
)
def test_stop_string_ending_inside_a_token_is_cut_exactly(
    tokenizers: dict[str, PreTrainedTokenizerBase], include_stop_str_in_output: bool, expected: str
) -> None:
    detokenizer, tokenizer = _gpt2_detokenizer(
        tokenizers, stop=["wor"], include_stop_str_in_output=include_stop_str_in_output
    )
    ids = tokenizer.encode("Hello world, how are you?")
    stop_reasons = [detokenizer.update([token_id]) for token_id in ids[:2]]
    assert stop_reasons == [None, "wor"]  # "ld" of " world" is dropped too
    assert detokenizer.output_text == expected
    assert detokenizer.get_next_output_text(finished=True, delta=True) == expected


@pytest.mark.parametrize(
    ("stop", "expected_stop", "expected_text"),
    [
        (["you", "how", "world"], "world", "Hello "),  # earliest position, not list order
        (["wo", "world"], "wo", "Hello "),  # same position: first in the list
        (["?", "o"], "o", "Hell"),
    ],
)
def test_earliest_stop_string_wins(
    tokenizers: dict[str, PreTrainedTokenizerBase],
    stop: list[str],
    expected_stop: str,
    expected_text: str,
) -> None:
    detokenizer, tokenizer = _gpt2_detokenizer(tokenizers, stop=stop)
    assert detokenizer.update(tokenizer.encode("Hello world, how are you?")) == expected_stop
    assert detokenizer.output_text == expected_text


def test_held_back_characters_are_released_at_finish(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    detokenizer, tokenizer = _gpt2_detokenizer(tokenizers, stop=["xyz!"])  # holds back 3 chars
    hello, world, *_ = tokenizer.encode("Hello world, how are you?")
    detokenizer.update([hello])
    assert detokenizer.get_next_output_text(finished=False, delta=True) == "He"
    detokenizer.update([world])
    assert detokenizer.get_next_output_text(finished=False, delta=True) == "llo wo"
    assert detokenizer.get_next_output_text(finished=False, delta=True) == ""
    assert detokenizer.get_next_output_text(finished=False, delta=False) == "Hello wo"
    assert detokenizer.get_next_output_text(finished=True, delta=True) == "rld"
    assert detokenizer.get_next_output_text(finished=True, delta=False) == "Hello world"


def test_held_back_text_never_shows_the_stop_string(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    detokenizer, tokenizer = _gpt2_detokenizer(tokenizers, stop=["world"])
    hello, world, *_ = tokenizer.encode("Hello world, how are you?")
    detokenizer.update([hello])
    assert detokenizer.get_next_output_text(finished=False, delta=True) == "H"
    assert detokenizer.update([world]) == "world"
    assert detokenizer.get_next_output_text(finished=True, delta=True) == "ello "


def test_include_stop_str_in_output_holds_nothing_back(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    detokenizer, tokenizer = _gpt2_detokenizer(
        tokenizers, stop=["world"], include_stop_str_in_output=True
    )
    hello, world, comma, *_ = tokenizer.encode("Hello world, how are you?")
    detokenizer.update([hello])
    assert detokenizer.get_next_output_text(finished=False, delta=True) == "Hello"
    assert detokenizer.update([world, comma]) == "world"
    assert detokenizer.get_next_output_text(finished=True, delta=True) == " world"


def test_stop_string_in_the_prompt_does_not_match(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    tokenizer = tokenizers["gpt2"]
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Please stop"), stop=["stop"])
    assert detokenizer.update(tokenizer.encode(" now")) is None
    assert detokenizer.get_next_output_text(finished=True, delta=False) == " now"


def test_multibyte_stop_string(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    detokenizer, tokenizer = _gpt2_detokenizer(tokenizers, stop=["世界"])
    stop_reasons = [detokenizer.update([i]) for i in tokenizer.encode("你好，世界！今天")[:11]]
    assert stop_reasons == [None] * 10 + ["世界"]  # "界" completes with the 11th byte token
    assert detokenizer.get_next_output_text(finished=True, delta=False) == "你好，"


def test_empty_stop_string_is_rejected(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        IncrementalDetokenizer(tokenizers["gpt2"], [], stop=["ok", ""])


_STOP_TEXTS = ["Hello world, how are you?\nFine, thanks.", "你好，世界！今天天气很好。🎉 done"]


@settings(max_examples=100, deadline=None)
@given(data=st.data(), include_stop_str_in_output=st.booleans())
def test_single_stop_string_cuts_at_its_first_occurrence(
    tokenizers: dict[str, PreTrainedTokenizerBase],
    data: st.DataObject,
    include_stop_str_in_output: bool,
) -> None:
    text = data.draw(st.sampled_from(_STOP_TEXTS))
    start = data.draw(st.integers(0, len(text) - 1))
    stop_str = text[start : start + data.draw(st.integers(1, 6))]
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=40))
    detokenizer, tokenizer = _gpt2_detokenizer(
        tokenizers, stop=[stop_str], include_stop_str_in_output=include_stop_str_in_output
    )

    deltas, stop_reason = [], None
    for chunk in _split(tokenizer.encode(text), sizes):
        stop_reason = detokenizer.update(chunk)
        if stop_reason is not None:
            break
        deltas.append(detokenizer.get_next_output_text(finished=False, delta=True))
    deltas.append(detokenizer.get_next_output_text(finished=True, delta=True))

    index = text.find(stop_str)
    expected = text[: index + len(stop_str) if include_stop_str_in_output else index]
    assert stop_reason == stop_str
    assert "".join(deltas) == expected == detokenizer.output_text


def test_slow_tokenizer_is_rejected() -> None:
    with pytest.raises(TypeError, match="not a fast tokenizer"):
        IncrementalDetokenizer(object(), [])  # type: ignore[arg-type]
