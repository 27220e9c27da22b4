"""The text and bytes of logprob tokens, in the context of the tokens before them.

A token's text in logprobs (vLLM's `Logprob.decoded_token`, the OpenAI `tokens` and `token`
fields) is the text it adds to the output at its position, as the incremental detokenizer emits
it. Decoding a token alone loses what depends on its neighbours: the SentencePiece piece
"▁there" alone decodes to "there" (a text's leading space is stripped), and a byte-level token
holding the first bytes of a character decodes to U+FFFD. In context "▁there" is " there", a
token that ends inside a character adds "" (the token that completes it carries the character),
and a special token that `skip_special_tokens` drops adds "". Thus `"".join(tokens)` is the text.
The top-k alternatives of a position are spelled in the same context: the text each would have
added had it been sampled there. vLLM's V0 detokenizer decoded logprob tokens the same way
(`decode_sequence_inplace`, `detokenize_incrementally` with the previous tokens); its V1 decodes
each token alone.
"""

from __future__ import annotations

import codecs
import functools
import re
from typing import TYPE_CHECKING, Any

from tokenizers import decoders

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import Logprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LogprobDetokenizer:
    """Gives each logprob position of one token sequence (a request's output, or its prompt)
    its token texts, decoded after the tokens before it.

    Each position costs one decode per alternative over a window of a few tokens (the
    IncrementalDetokenizer's), not over the whole text.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """`context_token_ids`: the tokens before the first position (the prompt, for output
        tokens; none for the prompt itself)."""
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            context_token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    def advance(self, token_id: int) -> str:
        """Append `token_id` (a token without logprobs, e.g. a prompt's first); its text."""
        num_chars = len(self._detokenizer.output_text)
        self._detokenizer.update([token_id])
        return self._detokenizer.output_text[num_chars:]

    def peek(self, token_id: int) -> str:
        """The text `token_id` would add at the next position (not appended)."""
        return self._detokenizer.peek(token_id)

    def finish(self) -> str:
        """Text that tokens still held for an unfinished character add when the sequence ends
        (U+FFFD, as the output text shows them); to append to the last token's text."""
        num_chars = len(self._detokenizer.output_text)
        return self._detokenizer.get_next_output_text(finished=True, delta=False)[num_chars:]


def logprob_entry(
    token_ids: list[int],
    logprobs: list[float],
    rank: int,
    decoder: LogprobDetokenizer | None,
) -> dict[int, Logprob]:
    """One position as vLLM returns it: the sampled (or prompt) token `token_ids[0]` with its
    `rank`, then the top-k `token_ids[1:]` ranked 1, 2, ..., each with its text at this position
    (None without a decoder). The sampled token is then appended to the decoder's context."""
    texts: dict[int, str | None] = {}
    if decoder is not None:
        texts = {t: decoder.peek(t) for t in token_ids[1:] if t != token_ids[0]}
    sampled_text = decoder.advance(token_ids[0]) if decoder is not None else None
    entry = {token_ids[0]: Logprob(logprobs[0], rank, sampled_text)}
    for top_rank, (token_id, logprob) in enumerate(
        zip(token_ids[1:], logprobs[1:], strict=True), start=1
    ):
        if token_id not in entry:
            entry[token_id] = Logprob(logprob, top_rank, texts.get(token_id))
    return entry


def first_token_text(
    tokenizer: PreTrainedTokenizerBase, token_id: int, skip_special_tokens: bool = True
) -> str:
    """The text of a sequence's first token (which has no logprob entry): at the start of a
    text, decoded as LogprobDetokenizer decodes the tokens after it."""
    decoder = LogprobDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    return decoder.advance(token_id)


class LogprobBytes:
    """The `bytes` of OpenAI chat logprobs for the positions of one sequence, in order.

    A token's bytes are the UTF-8 bytes of the text it adds, except that a token ending inside
    a character (whose text is "") gets its raw bytes, and the token that completes the
    character then gets the rest of the character's bytes. The bytes of all positions thus
    concatenate to the UTF-8 of the text, and no token shows EF BF BD (U+FFFD) for bytes it does
    not hold. Alternatives get their bytes by the same rule at their position.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._pending = b""  # raw bytes of the tokens of a character not complete yet

    def position(self, token_id: int, entry: dict[int, Logprob]) -> dict[int, bytes]:
        """The bytes of each token of one position's `entry` (sampled token `token_id`), then
        moves past the sampled token."""
        result = {t: self._bytes(t, logprob.decoded_token or "") for t, logprob in entry.items()}
        if entry[token_id].decoded_token:
            self._pending = b""
        else:
            self._pending += result[token_id]
        return result

    def _bytes(self, token_id: int, text: str) -> bytes:
        if text:
            data = text.encode()
            return data[len(self._pending) :] if data.startswith(self._pending) else data
        raw = _raw_token_bytes(self._backend, token_id)
        return raw if raw and _ends_inside_character(self._pending + raw) else b""


def _ends_inside_character(data: bytes) -> bool:
    """Whether `data` is valid UTF-8 up to a character whose last bytes are still missing."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return bool(decoder.getstate()[0])


@functools.lru_cache(maxsize=16)
def _added_token_ids(backend: Any) -> frozenset[int]:
    """Cached: walking the added vocabulary costs too much to repeat for each token."""
    return frozenset(backend.get_added_tokens_decoder())


_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=16)
def _byte_level_chars(backend: Any) -> dict[str, int] | None:
    """GPT-2's byte-to-character map, reversed, for byte-level BPE tokenizers; None for others."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's own map

    byte_to_char: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]
    return {char: byte for byte, char in byte_to_char.items()}


def _raw_token_bytes(backend: Any, token_id: int) -> bytes:
    """The bytes a (non-added) token stands for: its byte-level characters mapped back to bytes,
    a byte-fallback piece "<0xE4>" as that byte, else its piece's UTF-8 ("▁" as a space); b""
    for an added or unknown token."""
    if token_id in _added_token_ids(backend):
        return b""
    piece = backend.id_to_token(token_id)
    if piece is None:
        return b""
    chars = _byte_level_chars(backend)
    if chars is not None:
        if all(char in chars for char in piece):
            return bytes(chars[char] for char in piece)
        return b""
    match = _BYTE_FALLBACK_PIECE.fullmatch(piece)
    if match is not None:
        return bytes([int(match.group(1), 16)])
    data: bytes = piece.replace("\u2581", " ").encode()
    return data
