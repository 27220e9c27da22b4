"""Incremental detokenization of generated tokens, with stop strings, safe for streaming."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from pagedserve.engine.stop_matcher import StopMatcher

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded in front of the first generated ones, so that text whose form depends on
# what precedes it comes out right: SentencePiece strips the leading space only at the start of a
# text, and a prompt may end in the first bytes of a character. vLLM uses 5 as well
# (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_NUM_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for bytes that are not (yet) a character


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text one step at a time.

    Each new token is decoded together with a short window of the tokens before it (vLLM's
    prefix/read offsets):

        window_ids: | decoded to prefix_text | not emitted yet |
                    0                        read_offset       len(window_ids)

    The new text is decode(window) minus prefix_text. It is emitted only when decode(window) does
    not end in U+FFFD, i.e. when no character is still waiting for the rest of its bytes; then the
    window drops everything before read_offset and read_offset moves to its end. The window thus
    holds the tokens of the last emission and those not emitted yet, a few tokens whatever the
    output length, which bounds the cost per token.
    Decoding in context keeps the leading space of SentencePiece pieces ("▁the" -> " the") and
    joins characters split over several byte tokens.

    With `skip_special_tokens`, special token ids never enter the window: decoding would drop them
    anyway, and a long run of them would otherwise grow it. Needs a fast (tokenizers-backed)
    tokenizer; added tokens registered after the first detokenizer was built are not seen.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._backend = _backend_tokenizer(tokenizer)
        # Stop strings do not count until more than min_tokens tokens exist (vLLM's rule).
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        self._skip_special_tokens = skip_special_tokens
        self._skipped_ids: frozenset[int] = frozenset()
        if skip_special_tokens:
            self._skipped_ids = _special_token_ids(self._backend)
        # vLLM's only effect of spaces_between_special_tokens=False on fast tokenizers: an added
        # token right after another is emitted as its bare content (WordPiece-style decoders
        # would put a space in between).
        self._bare_added_tokens: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            added = self._backend.get_added_tokens_decoder()
            self._bare_added_tokens = {i: token.content for i, token in added.items()}
        self._previous_was_added = False

        self._window_ids = _prompt_context(prompt_token_ids, self._skipped_ids)
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)

        self._stop = list(stop or [])
        # One automaton for all stop strings: the cost per token does not grow with their
        # number (this runs on the API server's event loop). Raises ValueError for "".
        self._stop_matcher = StopMatcher(self._stop) if self._stop else None
        self._include_stop_str_in_output = include_stop_str_in_output
        # Characters that may be the start of a stop string are held back from streaming. With
        # include_stop_str_in_output nothing is: the text before a match is kept either way, and
        # a match always ends in text that has not been returned yet. The stop-string limits
        # of SamplingParams bound it (PAGEDSERVE_MAX_STOP_STRING_CHARS).
        self._num_held_chars = 0
        if self._stop and not include_stop_str_in_output:
            self._num_held_chars = max(len(stop_str) for stop_str in self._stop) - 1
        self._stop_reason: str | None = None
        self._output_text = ""
        self._num_returned_chars = 0  # of output_text, by delta calls of get_next_output_text

    @property
    def output_text(self) -> str:
        """All text so far, cut at the stop string (or after it with include_stop_str_in_output)."""
        return self._output_text

    def update(self, new_token_ids: list[int], *, stop_terminated: bool = False) -> str | None:
        """Append the newly generated tokens; return the stop string that matched (the request must
        then finish with finish_reason 'stop' and stop_reason = that string), else None.

        `stop_terminated` says that the last id is the EOS or stop token id that finished the
        request; as in vLLM, its text is then left out unless include_stop_str_in_output.
        """
        assert self._stop_reason is None, "update() after a stop string already matched"
        self._num_output_tokens += len(new_token_ids)
        if stop_terminated and not self._include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        num_chars_before = len(self._output_text)
        for token_id in new_token_ids:
            new_text = self._decode_next(token_id)
            if self._bare_added_tokens is not None:
                new_text = self._without_space_between_added(token_id, new_text)
            self._output_text += new_text
        if self._stop_matcher is not None and len(self._output_text) > num_chars_before:
            # Fed even before min_tokens (report=False), so a later match can start there.
            match = self._stop_matcher.feed(
                self._output_text[num_chars_before:],
                report=self._num_output_tokens > self._min_tokens,
            )
            if match is not None:
                self._stop_reason = self._cut_at_stop(*match)
        return self._stop_reason

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to return now: the new part since the last call if delta, else the whole text.
        While not finished, hold back the last len(longest stop string)-1 characters (they may be
        the start of a stop string), as vLLM does; when finished return everything.

        When finished without a stop string, bytes of a character that never completed are
        released as U+FFFD, as a one-shot decode shows them.
        """
        if finished and self._stop_reason is None:
            self._flush()
        end = len(self._output_text) - (0 if finished else self._num_held_chars)
        if not delta:
            return self._output_text[: max(end, 0)]
        start = self._num_returned_chars
        if end <= start:
            return ""
        self._num_returned_chars = end
        return self._output_text[start:end]

    def peek(self, token_id: int) -> str:
        """The text `token_id` would add if it came next (as update() would emit it, stop
        strings aside), without adding it: how logprobs spell the alternatives of a position.
        A special token that skip_special_tokens drops is spelled by its own text ("</s>"), as
        vLLM shows it: spelled "", such alternatives would be indistinguishable (and collapse
        into one key of a completion's top_logprobs)."""
        if token_id in self._skipped_ids:
            content: str = self._backend.id_to_token(token_id) or ""
            return content
        text = self._decode([*self._window_ids, token_id])
        new_text = ""
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
            new_text = text[len(self._prefix_text) :]
        if self._bare_added_tokens is not None and self._previous_was_added:
            return self._bare_added_tokens.get(token_id, new_text)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return text

    def _decode_next(self, token_id: int) -> str:
        """Text that `token_id` adds, or "" while it (with the tokens before it) ends inside a
        character or decodes to nothing."""
        if token_id in self._skipped_ids:
            return ""
        self._window_ids.append(token_id)
        text = self._decode(self._window_ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        # Slicing by length (not asserting text.startswith(prefix_text)): byte-fallback decoders
        # can rewrite earlier text, e.g. a lone <0x51> decodes to "Q" but to U+FFFD when invalid
        # bytes follow. What was returned cannot be taken back; carry on from here.
        new_text = text[len(self._prefix_text) :]
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        return new_text

    def _without_space_between_added(self, token_id: int, new_text: str) -> str:
        """`new_text`, or the bare content of an added token that follows another."""
        assert self._bare_added_tokens is not None
        content = self._bare_added_tokens.get(token_id)
        follows_added, self._previous_was_added = self._previous_was_added, content is not None
        return content if content is not None and follows_added else new_text

    def _flush(self) -> None:
        """Append the text of tokens still held for an unfinished character."""
        if self._read_offset == len(self._window_ids):
            return
        text = self._decode(self._window_ids)
        self._output_text += text[len(self._prefix_text) :]
        self._prefix_text, self._read_offset = text, len(self._window_ids)

    def _cut_at_stop(self, start: int, stop_index: int) -> str:
        """Cut the output text at the stop string that matched at `start` (after it with
        include_stop_str_in_output); returns that stop string. The match is the one that
        starts earliest among those ending in the new text, the first in `stop` on a tie
        (StopMatcher)."""
        stop_str = self._stop[stop_index]
        end = start + len(stop_str) if self._include_stop_str_in_output else start
        self._output_text = self._output_text[:end]
        return stop_str


def _backend_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The `tokenizers.Tokenizer` behind a fast tokenizer; its decode skips transformers'
    Python-side processing, which matters for a call per token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"{type(tokenizer).__name__} is not a fast tokenizer; load it with "
            "transformers.AutoTokenizer (tokenizer.json) to detokenize incrementally"
        )
    return backend


@functools.lru_cache(maxsize=16)
def _special_token_ids(backend: Any) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops. Cached per tokenizer because walking the
    added vocabulary costs ~50 us for Llama 3, too much to repeat for every request."""
    added = backend.get_added_tokens_decoder()
    return frozenset(token_id for token_id, token in added.items() if token.special)


def _prompt_context(prompt_token_ids: list[int], skipped_ids: frozenset[int]) -> list[int]:
    """The last prompt tokens that decoding keeps, to decode the first output tokens after."""
    context: list[int] = []
    for token_id in reversed(prompt_token_ids):
        if token_id not in skipped_ids:
            context.append(token_id)
            if len(context) == _NUM_PROMPT_CONTEXT_TOKENS:
                break
    context.reverse()
    return context
