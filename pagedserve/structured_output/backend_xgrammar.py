"""The xgrammar backend: one StructuredOutputsParams -> a compiled grammar -> per-sequence matchers.

Mirrors vLLM's `vllm/v1/structured_output/backend_xgrammar.py` (XgrammarBackend,
XgrammarGrammar). xgrammar is imported lazily: an engine that never sees a constraint never
loads it, and the worker processes never need it.
"""

import json
import re
from functools import lru_cache
from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.structured_outputs_params import StructuredOutputsParams

# xgrammar's C++ errors start "[11:12:06] /project/cpp/regex_converter.cc:94: ": the position
# in xgrammar's sources, which says nothing to a user.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")
_JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's json_object: any JSON object


def xgrammar_error_text(error: BaseException) -> str:
    """xgrammar's error message without its C++ source position (first line only)."""
    text = _CPP_PREFIX.sub("", str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


def constraint_key(params: StructuredOutputsParams) -> str:
    """The cache key of a constraint: its kind and value and the options that change the
    grammar, as canonical JSON (a schema dict and its JSON text with the same content give
    one key only when the text is canonical; the dict form always does)."""
    return json.dumps(params.as_dict(), sort_keys=True, separators=(",", ":"))


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (vLLM's `choice_as_grammar`).
    The strings are written as EBNF literals: JSON's escapes (\\", \\\\, \\n, \\uXXXX) are
    xgrammar's too."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_ebnf(grammar: str) -> bool:
    """GBNF/EBNF defines rules with `::=`; otherwise the text is taken as Lark (vLLM converts
    Lark grammars too; xgrammar parses Lark itself)."""
    return "::=" in grammar


def _json_schema_text(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The constraint as an xgrammar `Grammar` (parsed, not compiled against a vocabulary).

    Raises whatever xgrammar raises for an invalid schema, regex, grammar or structural tag
    (RuntimeError, xgrammar.InvalidJSONError, ...)."""
    import xgrammar as xgr

    kind = params.kind
    if kind == "json":
        assert params.json is not None
        return xgr.Grammar.from_json_schema(
            _json_schema_text(params.json), any_whitespace=not params.disable_any_whitespace
        )
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(
            _JSON_OBJECT_SCHEMA, any_whitespace=not params.disable_any_whitespace
        )
    if kind == "regex":
        assert params.regex is not None
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
    if kind == "grammar":
        assert params.grammar is not None
        if is_ebnf(params.grammar):
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_lark(params.grammar)
    assert kind == "structural_tag" and params.structural_tag is not None
    return _structural_tag_grammar(params.structural_tag)


def _structural_tag_grammar(text: str) -> Any:
    """vLLM's two structural-tag forms: the older {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}, and xgrammar's own format (a JSON object with "format")."""
    import xgrammar as xgr

    spec = json.loads(text)
    if isinstance(spec, dict) and "structures" in spec:
        tags = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in spec["structures"]
        ]
        return xgr.Grammar.from_structural_tag(tags, spec.get("triggers", []))
    return xgr.Grammar.from_structural_tag(text)


@lru_cache(maxsize=1024)
def _check_constraint(key: str) -> None:
    """Parse the constraint whose key this is; cached, so a constraint used by many requests
    is parsed once per process (errors are not cached: they raise)."""
    build_grammar(StructuredOutputsParams(**json.loads(key)))


def validate_structured_outputs(params: StructuredOutputsParams, param: str) -> None:
    """Check at request time that xgrammar can parse the constraint, so that a bad one is a
    400 before the request reaches the engine (vLLM's `validate_xgrammar_grammar`).

    Raises InvalidRequestError naming `param` (the request field the constraint came from:
    response_format, structured_outputs, guided_json, ...) with xgrammar's parse error, or
    for a whitespace_pattern, which xgrammar (0.2.x) cannot honour (it only has
    any_whitespace on or off: disable_any_whitespace)."""
    if params.whitespace_pattern is not None:
        raise InvalidRequestError(
            f"{param}.whitespace_pattern is not supported by the xgrammar backend (it cannot "
            "set JSON's whitespace regex); leave it null, or set disable_any_whitespace for "
            "JSON without optional whitespace",
            f"{param}.whitespace_pattern",
        )
    try:
        _check_constraint(constraint_key(params))
    except InvalidRequestError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError and its own classes
        what = {"json": "JSON schema", "json_object": "JSON schema", "choice": "choice"}.get(
            params.kind, params.kind
        )
        raise InvalidRequestError(
            f"invalid {what} in {param}: {xgrammar_error_text(e)}", param=param
        ) from None


class XgrammarBackend:
    """Compiles constraints against one model's vocabulary (vLLM's XgrammarBackend).

    tokenizer: the model's Hugging Face tokenizer. vocab_size: the width of the model's logits
    (`hf_config.vocab_size`), which may exceed len(tokenizer): the rows of the bitmask are
    ceil(vocab_size / 32) int32 words, and ids past the tokenizer are never allowed.
    stop_token_ids: the ids that end a sequence (the model's EOS ids); a grammar accepts one
    of them once it is complete, and then terminates. Attribute `stop_token_ids`: the set
    xgrammar's matchers use (these and the tokenizer's EOS).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        stop = list(stop_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and eos not in stop:  # the InputProcessor stops on it too
            stop.append(eos)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop or None
        )
        # A matcher terminates only when it accepts one of these (we never set xgrammar's
        # terminate_without_stop_token): other tokens need no is_terminated() call.
        self.stop_token_ids = frozenset(info.stop_token_ids)
        # Our own cache (StructuredOutputManager) dedupes and counts; xgrammar's would only
        # hold the same grammars twice.
        self.compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The constraint compiled for this vocabulary (an xgrammar CompiledGrammar)."""
        return self.compiler.compile_grammar(build_grammar(params))

    def new_matcher(self, compiled: Any) -> "XgrammarGrammar":
        return XgrammarGrammar(compiled)


class XgrammarGrammar:
    """One sequence's position in a compiled grammar (vLLM's XgrammarGrammar): accepts
    tokens, fills its row of the step's bitmask, and rolls back accepted tokens."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar 0.2
        self.num_processed_tokens = 0
        # is_terminated() as of the last accept or rollback, kept here so that a step's fill
        # reads a Python attribute per row, not a C++ call (the manager's batched accept
        # sets it too).
        self.terminated = False

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by `token_ids`; False (and no advance past it) at a token the grammar does
        not allow. A terminated grammar accepts nothing more."""
        accepted = True
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                accepted = False
                break
            self.num_processed_tokens += 1
        self.terminated = bool(self.matcher.is_terminated())
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_processed_tokens -= num_tokens
            self.terminated = bool(self.matcher.is_terminated())

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 torch tensor or
        numpy array, bit t of word t // 32 set = token t allowed). Raises RuntimeError (from
        xgrammar) once the grammar has terminated."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())
