"""The request fields that ask for structured outputs, turned into one StructuredOutputsParams.

vLLM accepts them on /v1/completions and /v1/chat/completions alike:
- OpenAI's `response_format`: {"type": "text"} (nothing), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}, and
  vLLM's {"type": "structural_tag", "structures": [...], "triggers": [...]};
- vLLM's `structured_outputs` extra: a dict of StructuredOutputsParams fields (with options
  only, such as `disable_any_whitespace`, it sets them on another field's constraint);
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (`guided_whitespace_pattern`, and structured_outputs' `whitespace_pattern`, are 400s:
  xgrammar cannot set JSON's whitespace regex).
Each constraint is parsed here (xgrammar), so that a bad one is a 400 naming its field.
"""

import dataclasses
import json
from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.structured_output.backend_xgrammar import validate_structured_outputs
from pagedserve.structured_outputs_params import StructuredOutputsParams

from .protocol import SamplingFields

# The fields that carry a constraint, and the StructuredOutputsParams field of the guided_*.
_GUIDED_KINDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_of(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None. Raises InvalidRequestError naming the field for a
    malformed value, two constraints at once, or a schema/regex/grammar xgrammar cannot
    parse (with its parse error)."""
    if request.guided_decoding_backend is not None:
        raise InvalidRequestError(
            "guided_decoding_backend is not a request field (vLLM removed it); the server "
            "chooses the grammar engine (--structured-outputs-backend)",
            "guided_decoding_backend",
        )
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = _from_response_format(request.response_format)
    if response_format is not None:
        found.append(("response_format", response_format))
    # structured_outputs with options only (disable_any_whitespace, ...) sets them on the
    # constraint given by another field (response_format, guided_*); vLLM never 400s here
    # (some of its versions keep such options, the newest drop them).
    options: dict[str, Any] = {}
    if _only_options(request.structured_outputs):
        options = request.structured_outputs
    elif request.structured_outputs is not None:
        found.append(("structured_outputs", _from_dict(request.structured_outputs)))
    for name, kind in _GUIDED_KINDS.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, _params(name, **{kind: value})))
    if request.guided_whitespace_pattern is not None:
        # xgrammar cannot set JSON's whitespace regex: refused, never silently ignored.
        raise InvalidRequestError(
            "guided_whitespace_pattern is not supported by the xgrammar backend (it cannot set "
            "JSON's whitespace regex); leave it null, or use structured_outputs' "
            "disable_any_whitespace for JSON without optional whitespace",
            "guided_whitespace_pattern",
        )
    if len(found) > 1:
        raise InvalidRequestError(
            f"give one structured-output constraint, got {[name for name, _ in found]}",
            found[1][0],
        )
    if not found:
        if options:  # options of no constraint: the usual "exactly one of" error
            _from_dict(options)
        return None
    name, params = found[0]
    if options:
        try:
            params = dataclasses.replace(params, **options)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None
    validate_structured_outputs(params, name)
    return params


# StructuredOutputsParams' fields that are options of a constraint, not a constraint.
_OPTION_FIELDS = frozenset(
    {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
     "whitespace_pattern"}
)  # fmt: skip


def _only_options(value: Any) -> bool:
    """`value` is a non-empty dict of option fields only (no constraint)."""
    return isinstance(value, dict) and bool(value) and set(value) <= _OPTION_FIELDS


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs), its errors naming `field`."""
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e).replace("structured_outputs", field), field) from None
    except TypeError as e:  # an unknown key
        raise InvalidRequestError(f"{field}: {e}", field) from None


def _from_dict(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "structured_outputs must be an object of StructuredOutputsParams fields (json, "
            "regex, choice, grammar, json_object, structural_tag, ...)",
            "structured_outputs",
        )
    return _params("structured_outputs", **value)


def _from_response_format(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format (and vLLM's structural_tag type) as a constraint."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
            raise InvalidRequestError(
                'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                '"schema": {...}} with the schema an object',
                "response_format",
            )
        schema = spec["schema"]
        if schema is False:  # JSON Schema's `false`: no value is valid; never ends
            raise InvalidRequestError(
                "response_format.json_schema.schema is false, a schema that no output satisfies",
                "response_format",
            )
        # `true`: any JSON value, as the empty schema.
        return _params("response_format", json=schema if isinstance(schema, dict) else {})
    if kind == "structural_tag":
        return _params("response_format", structural_tag=json.dumps(value))
    raise InvalidRequestError(
        f"response_format type must be one of text, json_object, json_schema, structural_tag; "
        f"got {kind!r}",
        "response_format",
    )
