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
        ("functions", [{"name": "f"}]),  # the deprecated form of tools
        ("logit_bias", {"42": 5}),
        ("prompt_logprobs", 1),  # vLLM's, in no list: refused
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
        "top_logprobs": 0,
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
    assert params.logprobs is None


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("request_type", "fields", "logprobs"),
    [
        (ChatRequest, {"logprobs": True, "top_logprobs": 3}, 3),
        (ChatRequest, {"logprobs": True}, 0),  # the generated tokens' own, no alternatives
        (ChatRequest, {"logprobs": True, "top_logprobs": None}, 0),
        (ChatRequest, {"logprobs": False, "top_logprobs": 0}, None),
        (CompletionRequest, {"logprobs": 2}, 2),
        (CompletionRequest, {"logprobs": 0}, 0),
        (CompletionRequest, {"logprobs": None}, None),
    ],
)
def test_logprobs_reach_vllms_sampling_params(
    request_type: Any, fields: dict[str, Any], logprobs: int | None
) -> None:
    base = CHAT if request_type is ChatRequest else TEXT
    params = request_type.model_validate({**base, **fields}).sampling_params(16)
    assert params.logprobs == logprobs


@pytest.mark.parametrize(
    ("request_type", "fields", "says"),
    [
        (ChatRequest, {"top_logprobs": 3}, "logprobs must be true"),  # as OpenAI and vLLM
        (ChatRequest, {"logprobs": False, "top_logprobs": 3}, "logprobs must be true"),
        (ChatRequest, {"logprobs": True, "top_logprobs": -2}, "greater than or equal to -1"),
        (ChatRequest, {"logprobs": "yes"}, "valid boolean"),
        (ChatRequest, {"logprobs": True, "top_logprobs": "3"}, "valid integer"),
        (CompletionRequest, {"logprobs": True}, "valid integer"),  # a number, not a flag
        (CompletionRequest, {"logprobs": -2}, "greater than or equal to -1"),
        (CompletionRequest, {"top_logprobs": 2}, "top_logprobs is a chat field"),
    ],
)
def test_bad_logprobs_fields_are_errors_naming_them(
    request_type: Any, fields: dict[str, Any], says: str
) -> None:
    base = CHAT if request_type is ChatRequest else TEXT
    with pytest.raises(ValidationError, match=says) as refused:
        request_type.model_validate({**base, **fields})
    assert "logprobs" in str(refused.value)
