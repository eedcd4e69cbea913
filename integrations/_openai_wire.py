"""The OpenAI request bodies the guarded server accepts, as pydantic models.

``ChatRequest`` (``/v1/chat/completions``) and ``CompletionRequest`` (``/v1/completions``) hold
the sampling fields the server serves (``_openai_fields.SERVED``) and turn them into vLLM
``SamplingParams``; any other field that asks for something is refused by name, and trust
flags are strict booleans. Messages become the guardrail's own ``Message`` / ``Segment``.

Example:
    >>> body = {"model": "m", "messages": [{"role": "tool", "content": "doc"}], "top_k": 5}
    >>> ChatRequest.model_validate(body).messages[0].message().segments()[0].kind
    'data'
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from guardrail.probe.prompts import Message, Segment

from ._openai_fields import refused_field
from ._openai_tools import normalised_tools

__all__ = ["ChatRequest", "CompletionRequest"]


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = False


class _JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(default="response", min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")


class _ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``, served by
    vLLM's structured outputs (the answer is constrained to valid JSON, or to the schema)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> _ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self

    def structured_outputs(self) -> Any:
        from vllm.sampling_params import StructuredOutputsParams

        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is not None:  # present exactly with type json_schema
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class _Sampling(BaseModel):
    """The OpenAI sampling fields this server honours (and vLLM's extras ``ignore_eos``,
    ``top_k``, ``min_p``, ``repetition_penalty``); any other field set to a value that asks for
    something is refused (``_openai_fields``), never ignored."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_field_ignored(cls, data: Any) -> Any:
        name = refused_field(data) if isinstance(data, dict) else None
        if name is not None:
            raise ValueError(
                f"the field {name!r} is not served by guardrail-serve: remove it (the answer "
                "would not honour it); docs/serving.md lists the fields served"
            )
        return data

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    ignore_eos: StrictBool = False
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    response_format: _ResponseFormat | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's ``SamplingParams.logprobs``: how many most likely tokens each generated
        token's logprobs list (-1: the whole vocabulary), or None for no logprobs."""
        return None

    def sampling_params(self, default_max_tokens: int) -> Any:
        from vllm import SamplingParams

        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop or None,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs,
            structured_outputs=None
            if self.response_format is None
            else self.response_format.structured_outputs(),
            **{
                name: value
                for name in _SAMPLING_EXTRAS
                if (value := getattr(self, name)) is not None
            },
        )


_SAMPLING_EXTRAS = (
    "frequency_penalty",
    "presence_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
)
"""Fields passed to vLLM's ``SamplingParams`` under the same name, when a request sets them."""


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str
    guardrail_kind: Literal["instruction", "data"] | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[_Part] | None = None
    trusted: StrictBool | None = None  # "yes" is an error, never a trusted message
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's: the call it answers

    def message(self) -> Message:
        calls, call_id = self.tool_calls or None, self.tool_call_id
        if self.content is None or isinstance(self.content, str):
            content = self.content or ""
            return Message(
                role=self.role,
                content=content,
                trusted=self.trusted,
                tool_calls=calls,
                tool_call_id=call_id,
            )
        default = Message(role=self.role, content="", trusted=self.trusted).segments()[0].kind
        parts = [Segment(text=p.text, kind=p.guardrail_kind or default) for p in self.content]
        return Message(role=self.role, content=parts, tool_calls=calls, tool_call_id=call_id)


class _NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatRequest(_Sampling):
    messages: list[_ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    # the upper bound is the engine's (--max-logprobs, 20 by default): checked by the server
    top_logprobs: StrictInt | None = Field(default=None, ge=-1)
    # tools: the template renders them, vLLM's tool parser reads the calls (_openai_tools)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("tools")
    @classmethod
    def _tools_as_vllm_has_them(cls, tools: list[dict[str, Any]] | None) -> Any:
        if not tools:  # [] asks for nothing
            return None
        from pydantic import ValidationError

        try:
            return normalised_tools(tools)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "a tool"
            raise ValueError(f"invalid tool ({where}: {error['msg']})") from None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatRequest:
        if self.tool_choice not in (None, "none") and not self.tools:  # as vllm serve
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(self.tool_choice, _NamedToolChoice):
            name = self.tool_choice.function.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(
                    'tool_choice: a named function needs {"type": "function", "function": '
                    '{"name": "my_function"}}'
                )
            if name not in {t["function"]["name"] for t in self.tools or ()}:
                raise ValueError(
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`"
                )
        return self

    @property
    def tool_choice_value(self) -> Any:
        """``tool_choice`` as sent ("auto" when tools are given without one, as in OpenAI and
        ``vllm serve``); a named function as its object."""
        if isinstance(self.tool_choice, _NamedToolChoice):
            return self.tool_choice.model_dump()
        if self.tool_choice is None and self.tools:
            return "auto"
        return self.tool_choice

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):  # as OpenAI and vllm serve
            raise ValueError("top_logprobs is set, so logprobs must be true")
        return top

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)
    data: str | None = None
    # the most likely tokens listed besides each generated one (OpenAI: up to 5; vllm serve
    # and this server: up to the engine's --max-logprobs, 20 by default)
    logprobs: StrictInt | None = Field(default=None, ge=-1)

    @model_validator(mode="before")
    @classmethod
    def _no_chat_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("top_logprobs") not in (None, 0):
            raise ValueError("top_logprobs is a chat field: a completion asks for logprobs: N")
        return data

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
