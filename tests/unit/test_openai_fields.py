"""No OpenAI request field is ignored silently: each is served, harmless, or refused."""

from __future__ import annotations

from typing import Any

import pytest
from guardrail.integrations._openai_fields import NO_EFFECT, REFUSED, SERVED, refused_field
from guardrail.integrations.serving import ChatRequest, CompletionRequest
from pydantic import ValidationError


def _openai_fields() -> set[str]:
    from openai.types import completion_create_params as text
    from openai.types.chat import completion_create_params as chat

    fields = set(chat.CompletionCreateParamsBase.__annotations__)
    fields |= set(text.CompletionCreateParamsBase.__annotations__)
    return fields | {"stream"}  # on the streaming / non-streaming subclasses


def test_every_field_of_the_openai_request_types_is_in_exactly_one_list() -> None:
    lists = {"served": SERVED, "no effect": NO_EFFECT, "refused": REFUSED}
    for field in sorted(_openai_fields()):
        homes = [name for name, members in lists.items() if field in members]
        assert len(homes) == 1, f"{field!r} is in {homes or 'no list'}"


def test_the_served_fields_are_the_request_models_fields() -> None:
    modelled = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields)
    assert modelled == SERVED | {"user"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("logprobs", True),
        ("top_logprobs", 3),
        ("logit_bias", {"42": 5}),
        ("tool_choice", "required"),
        ("min_tokens", 3),  # in no list: refused too
    ],
)
def test_a_refused_field_that_asks_for_something_is_an_error_naming_it(
    field: str, value: Any
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    assert refused_field(body) == field
    with pytest.raises(ValidationError, match=f"the field '{field}' is not served"):
        ChatRequest.model_validate(body)


def test_off_values_and_bookkeeping_fields_are_accepted() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "logprobs": False,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "user": "u-1",
        "metadata": {"team": "a"},
        "store": False,
        "presence_penalty": 0.5,
        "top_k": 20,
    }
    request = ChatRequest.model_validate(body)
    params = request.sampling_params(16)
    assert (params.presence_penalty, params.top_k, params.max_tokens) == (0.5, 20, 16)
