"""A lower bound on the number of tokens of a text, computed without tokenizing it, so that a
prompt of megabytes is refused in milliseconds instead of after seconds of tokenizing and
gigabytes of memory (the tokenizer keeps offsets and alignments per character).

The bound must never exceed the true count: a prompt that would fit is never refused. It is
derived from the tokenizer's own description (`tokenizer.json`) and holds when:

- the model is BPE or Unigram: every token is a vocabulary entry, so it covers at most
  `longest` characters of the normalized text, where `longest` is the longest entry's
  spelling (byte-level BPE spells each byte as one character, so a Python character is at
  least one; a byte-fallback token `<0x41>` spells six characters and covers at most one);
- the normalizer does not shrink the text by more than a known factor (NFC/NFKC compose at
  most 4 code points into one; `Replace` of a literal string shrinks it by the ratio of their
  lengths; `Prepend` only adds), and the pre-tokenizer drops no characters;
- unknown characters: with `fuse_unk` (and no complete byte fallback) a run of characters
  outside the vocabulary becomes ONE token, however long. Then the text is counted in units:
  each character that is a one-character vocabulary entry (other than whitespace and the
  normalizer's targets, which may change) is a unit, and so is each maximal run of the other
  characters. Every unit is at least one normalized character and an unknown token never
  spans a known character, so a token covers at most `longest` units.

So `tokens >= units / (longest * shrink)`. Other tokenizers (WordPiece, WordLevel, slow
Python tokenizers, a normalizer that strips characters, `fuse_unk` with a normalizer that may
rewrite known characters) get no bound (None): their prompts are bounded only by the server's
request-body limit, and by max_model_len after tokenizing.
"""

import functools
import json
import re
from typing import Any

from pagedserve.errors import InvalidRequestError

_COMPOSING = {"NFC": 4, "NFKC": 4}  # most code points that canonical composition joins
_NOT_SHRINKING = {"NFD", "NFKD", "Lowercase", "Prepend"}
_KEEPING_PRE_TOKENIZERS = {"Metaspace", "ByteLevel", "Digits", "Punctuation", "UnicodeScripts"}


@functools.lru_cache(maxsize=8)  # holds the tokenizer, so its cached bound never goes stale
def token_bound(tokenizer: Any) -> tuple[int, int, re.Pattern[str] | None] | None:
    """(longest, shrink, unknown) of a tokenizer, or None when no sound bound is known.
    `unknown` (None: every character is at least one unit) matches the runs of characters
    that may fuse into one unknown token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") not in ("BPE", "Unigram"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None  # "##x" / "x</w>" symbols: a character in the vocabulary may still be unk
    vocab = tokenizer.get_vocab()
    longest = max((len(token) for token in vocab), default=0)
    shrink = _shrink(spec.get("normalizer"))
    if not longest or shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    byte_fallback = model.get("byte_fallback") and all(f"<0x{i:02X}>" in vocab for i in range(256))
    fuses = model.get("fuse_unk", model.get("type") == "Unigram") and not byte_fallback
    if not fuses:
        return longest, shrink, None
    if shrink != 1:
        return None  # a composing normalizer can turn known characters into unknown ones
    changed = _replaced_characters(spec.get("normalizer"))
    known = sorted(t for t in vocab if len(t) == 1 and not t.isspace() and t not in changed)
    alternatives = "".join(re.escape(c) for c in known)
    return longest, 1, re.compile(f"[^{alternatives}]+" if known else "(?s).+")


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many characters of the text one normalized character comes from at most."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            part_factor = _shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind in _NOT_SHRINKING:
        return 1
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if not pattern or not content:
            return None  # a regex, or a deletion: no bound
        return max(1, -(-len(pattern) // len(content)))
    return None


def _replaced_characters(normalizer: dict[str, Any] | None) -> set[str]:
    if normalizer is None:
        return set()
    if normalizer.get("type") == "Sequence":
        return set().union(*(_replaced_characters(n) for n in normalizer["normalizers"]))
    if normalizer.get("type") == "Replace":
        return set((normalizer.get("pattern") or {}).get("String") or "")
    return set()


def _keeps_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer passes every character on (it may split, not drop)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def min_tokens(tokenizer: Any, text: str, enough: int) -> int | None:
    """A lower bound on the tokens of `text` (None: no sound bound for this tokenizer), exact
    enough to say whether it reaches `enough`: a text too short to reach it in the best case
    is answered from its length alone, without scanning it."""
    bound = token_bound(tokenizer)
    if bound is None:
        return None
    longest, shrink, unknown = bound
    per_token = longest * shrink
    if unknown is None:
        return -(-len(text) // per_token)
    if len(text) < enough * per_token:
        return 0  # even with no unknown character it is under `enough`: skip the scan
    known, num_runs = unknown.subn("", text)  # each run of unknown characters is one unit
    return -(-(len(known) + num_runs) // per_token)


def check_prompt_chars(
    tokenizer: Any, text: str, max_model_len: int, param: str = "prompt"
) -> None:
    """Refuse, before tokenizing, a text that is surely max_model_len tokens or more (see the
    module's docstring for why the bound never refuses a text that fits). Raises
    InvalidRequestError naming `param`."""
    bound = min_tokens(tokenizer, text, max_model_len)
    if bound is not None and bound >= max_model_len:
        raise InvalidRequestError(
            f"the prompt ({len(text)} characters) is too long: it is at least {bound} tokens, "
            f"and it must be shorter than max_model_len ({max_model_len}) tokens",
            param,
        )
