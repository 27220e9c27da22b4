"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's API).

Source: vllm/sampling_params.py `StructuredOutputsParams` (vLLM >= 0.10.2; before it,
`GuidedDecodingParams`). Exactly one constraint is given per request.
"""

from dataclasses import dataclass, fields
from typing import Any

from pagedserve.errors import InvalidRequestError

# The constraint kinds, one of which a request gives.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """One output constraint.

    json: a JSON schema (dict, or its JSON text) the output must validate against.
    regex: a regular expression the whole output must match.
    choice: the output is exactly one of these strings.
    grammar: an EBNF (GBNF) grammar the output must parse under.
    json_object: True: the output is any JSON object (OpenAI's `{"type": "json_object"}`).
    structural_tag: vLLM's structural-tag JSON text (tagged regions, each with a schema).
    disable_any_whitespace: JSON without optional whitespace.
    disable_additional_properties: objects of a schema without "additionalProperties" get
        none (vLLM's flag; by default xgrammar allows them only where the schema does).
    whitespace_pattern: the regex of JSON's optional whitespace (vLLM's field; the xgrammar
        backend cannot honour it, so a non-null value is refused when the request is checked).

    Raises InvalidRequestError (a ValueError) when none or more than one kind is given, or a
    field has the wrong type; whether the constraint itself parses is checked by the grammar
    engine when it compiles it.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        # JSON Schema's `false` (not "no json"): no value is valid. Users may pass it.
        if self.json is False:  # type: ignore[comparison-overlap]
            raise InvalidRequestError(
                "structured_outputs.json is false, a schema that no output satisfies",
                param="structured_outputs",
            )
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs takes exactly one of {list(CONSTRAINT_KINDS)}, got "
                f"{given or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise InvalidRequestError(
                    "structured_outputs.choice must be a non-empty list of strings",
                    param="structured_outputs",
                )
            if not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(
                    "structured_outputs.choice must hold only strings", param="structured_outputs"
                )
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a string, got {type(value).__name__}",
                    param="structured_outputs",
                )
        for name in (
            "json_object",
            "disable_fallback",
            "disable_any_whitespace",
            "disable_additional_properties",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "json_object" and value is None):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a boolean, got {type(value).__name__}",
                    param="structured_outputs",
                )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object or its JSON text)",
                param="structured_outputs",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of CONSTRAINT_KINDS."""
        return next(n for n in CONSTRAINT_KINDS if getattr(self, n) not in (None, False))

    def as_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults (e.g. a cache key's source)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != f.default
        }
