"""`structured_outputs` with options only (`disable_any_whitespace`, ...) next to another
constraint field sets the options on that constraint (vLLM never 400s there); alone, or with a
constraint of its own next to another, it is a 400 naming the field."""

from typing import Any

import pytest

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.structured_fields import structured_outputs_of
from pagedserve.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}


def _requests(**fields: Any) -> list[Any]:
    """The same fields on /v1/completions' and /v1/chat/completions' request models."""
    return [
        CompletionRequest(model="m", prompt="x", **fields),
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **fields),
    ]


@pytest.mark.parametrize(
    "constraint, expected",
    [
        ({"response_format": JSON_SCHEMA}, {"json": SCHEMA}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ],
)  # fmt: skip
def test_options_only_are_set_on_the_other_fields_constraint(
    constraint: dict[str, Any], expected: dict[str, Any]
) -> None:
    options = {"disable_any_whitespace": True, "disable_additional_properties": True}
    for request in _requests(**constraint, structured_outputs=options):
        params = structured_outputs_of(request)
        assert params is not None
        for name, value in {**expected, **options}.items():
            assert getattr(params, name) == value, name
    for request in _requests(**constraint):  # without them: the defaults
        params = structured_outputs_of(request)
        assert params is not None and not params.disable_any_whitespace


def test_options_alone_or_two_constraints_are_400s() -> None:
    for request in _requests(structured_outputs={"disable_any_whitespace": True}):
        with pytest.raises(InvalidRequestError, match="exactly one of") as info:
            structured_outputs_of(request)
        assert info.value.param == "structured_outputs"
    two = {"regex": "[a-z]+", "disable_any_whitespace": True}
    for request in _requests(response_format={"type": "json_object"}, structured_outputs=two):
        with pytest.raises(InvalidRequestError, match="one structured-output constraint"):
            structured_outputs_of(request)
