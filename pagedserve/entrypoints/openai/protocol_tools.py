"""Pydantic models of OpenAI's tool calling (vLLM's names): the tools of a request, the
`tool_choice`, and the tool calls of a response and of its stream chunks."""

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as protocol.OpenAIModel (no import circle)


class FunctionDefinition(_Model):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(_Model):
    name: str


class ChatCompletionNamedToolChoiceParam(_Model):
    """`tool_choice={"type": "function", "function": {"name": ...}}`: call this one."""

    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


ToolChoice = (
    Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None
)  # fmt: skip


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as the model wrote it


def make_tool_call_id() -> str:
    """A tool call's id (vLLM's default form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCall(_Model):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> Any:
        # The first delta of a call carries the name; later ones only argument text.
        data = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class DeltaToolCall(_Model):
    """A piece of a streamed tool call: the first carries `id`, `type` and the name (and
    `arguments` text so far, usually ""), the next ones argument text; `index` is the call's
    place in the message, which clients join the pieces by."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> Any:
        data = handler(self)
        return {key: value for key, value in data.items() if value is not None}
