"""Tools through the guarded server: the session's server (``served`` in tests/conftest.py,
shared with test_serving.py), whose tiny Llama renders tools with a Hermes-style template
(``tests/tool_templates.SERVED_TEMPLATE``) and which runs with ``--enable-auto-tool-choice
--tool-call-parser hermes``, driven by the real ``openai`` client. Requests pick the server's
``flag_only`` policy set (a verdict on every answer, none blocked) unless a test says otherwise.

The tiny random model never writes a ``<tool_call>`` itself, so one test puts that text in the
guarded stream (the verdict and the tokens stay the engine's) to show the server's answer has
the calls vLLM's parser reads; the others run the engine as it is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from guardrail.integrations._openai_tools import normalised_tools
from guardrail.integrations.serving import parse_command

from guardrail.probe.prompts import ChatWithTools, prepare_prompt
from tests.tool_templates import TOOL

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(served: tuple[str, FastAPI]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{served[0]}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        default_headers={"x-guardrail-policies": "flag_only"},
    )


def _prepared(model_dir: Path, request: Any) -> Any:
    """The request as the guard renders it, on the served model's own tokenizer."""
    from transformers import AutoTokenizer

    return prepare_prompt(request, AutoTokenizer.from_pretrained(str(model_dir)))


def test_the_tools_reach_the_template(client: openai.OpenAI, served_model_dir: Path) -> None:
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[TOOL], max_tokens=4, temperature=0
    )
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0
    )
    tools = normalised_tools([TOOL])  # as vLLM's request model hands them to the template
    prepared = _prepared(served_model_dir, ChatWithTools(messages=MESSAGES, tools=tools))
    assert '"name": "get_weather"' in prepared.text  # the tool, as the template renders it
    verdict = answer.model_extra["guardrail"]
    assert answer.usage.prompt_tokens == len(prepared.token_ids)  # the engine ran that prompt
    assert [tuple(s) for s in verdict["instruction_spans"]] == prepared.instruction_spans
    assert plain.usage.prompt_tokens == len(_prepared(served_model_dir, MESSAGES).token_ids)
    assert plain.usage.prompt_tokens < len(prepared.token_ids)
    assert answer.choices[0].finish_reason in ("length", "stop")  # no call in random text
    assert verdict["action"] in ("allow", "flag")


def test_a_tool_call_in_the_models_text_is_answered_as_tool_calls(
    client: openai.OpenAI, served: tuple[str, FastAPI], monkeypatch: pytest.MonkeyPatch
) -> None:
    guard = served[1].state.guard
    real_stream = guard.stream
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    async def calling(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        first = True
        async for chunk in real_stream(*args, **kwargs):
            yield dataclasses.replace(chunk, text=call if first else "")
            first = False

    monkeypatch.setattr(guard, "stream", calling)
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[TOOL], max_tokens=2, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [made] = choice.message.tool_calls
    assert made.function.name == "get_weather"
    assert json.loads(made.function.arguments) == {"city": "Paris"}
    assert answer.model_extra["guardrail"]["action"] in ("allow", "flag")
    # tool_choice "none": the same text is the answer's content, no calls read
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[TOOL], tool_choice="none", max_tokens=2
    )
    assert plain.choices[0].message.content == call and not plain.choices[0].message.tool_calls


CLOCK = {  # strict, no parameters: the one answer the constraint allows is short
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        "strict": True,
    },
}


@pytest.mark.parametrize(
    ("choice", "finish"),
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")],
)
def test_a_forced_call_is_made_by_the_tiny_model_itself(
    client: openai.OpenAI, choice: Any, finish: str
) -> None:
    """vLLM's structural tag constrains the tiny model's answer to a Hermes call of the strict
    tool, which vLLM's parser reads back: a call made and read end to end, no text put in."""
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[CLOCK],
        tool_choice=choice,
        parallel_tool_calls=False,  # one call, then the answer ends (else the model goes on)
        max_tokens=64,
        temperature=0,
    )
    made = answer.choices[0]
    assert made.finish_reason == finish, made
    assert [c.function.name for c in made.message.tool_calls or ()] == ["get_time"]
    assert json.loads(made.message.tool_calls[0].function.arguments) == {}


def test_a_blocked_request_with_tools_is_a_403(client: openai.OpenAI) -> None:
    with pytest.raises(openai.PermissionDeniedError) as blocked:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=[TOOL],
            max_tokens=4,
            extra_headers={"x-guardrail-policies": "block_all"},
        )
    assert blocked.value.body["code"] == "blocked"


def test_a_tool_conversation_renders_and_answers(client: openai.OpenAI) -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 20C", "tool_call_id": "c1"},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=[TOOL], max_tokens=4, temperature=0
    )
    assert answer.usage.prompt_tokens > 0
    assert answer.model_extra["guardrail"]["data_spans"]  # the tool result is data


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"stream": True}, "stream: true with tools is not served"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "send_mail"}}},
            "does not match any of the specified `tools`",
        ),
        ({"tools": [{"function": {}}]}, "invalid tool"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(
    client: openai.OpenAI, fields: dict[str, Any], says: str
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "tools": [TOOL], **fields}
    with pytest.raises(openai.BadRequestError, match=says):
        client.post("/chat/completions", body=body, cast_to=object)


def test_guardrail_serve_takes_the_tool_flags_as_vllm_serve() -> None:
    args, engine = parse_command(
        ["/models/m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")
    assert not {"enable_auto_tool_choice", "tool_call_parser"} & set(engine)
