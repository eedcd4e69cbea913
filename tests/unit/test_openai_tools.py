"""Tool calling in the guarded server's requests and answers (``_openai_tools``): the flags as
``vllm serve`` takes them, the 400s that name what is not served, and calls read from real
model text by vLLM's own ``hermes`` parser on the tiny model's tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from guardrail.integrations._openai_tools import ToolCalling, ToolCallReader
from guardrail.integrations.serving import ChatRequest
from pydantic import ValidationError

from guardrail.errors import ConfigError
from guardrail.probe.prompts import ChatWithTools
from tests.tool_templates import TOOL

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
AUTO = ToolCalling(enable_auto_tool_choice=True, tool_call_parser="hermes")
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_the_flags_are_checked_as_vllm_serve_checks_them() -> None:
    with pytest.raises(ConfigError, match="requires --tool-call-parser"):
        ToolCalling(enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match=r"invalid tool call parser: nope .*hermes"):
        ToolCalling(tool_call_parser="nope")
    assert AUTO.auto and not ToolCalling(tool_call_parser="hermes").auto


@pytest.mark.parametrize(
    ("tools", "choice", "stream", "says"),
    [
        (ToolCalling(), "auto", False, '"auto" tool choice requires --enable-auto-tool-choice'),
        (ToolCalling(tool_call_parser="hermes"), "auto", False, "--enable-auto-tool-choice"),
        (ToolCalling(), "required", False, 'tool_choice="required" requires --tool-call-parser'),
        (ToolCalling(), NAMED, False, 'tool_choice=function "get_weather" requires'),
        (AUTO, "auto", True, "stream: true with tools is not served"),
        (AUTO, "required", True, "stream: true with tools is not served"),
        (ToolCalling(), "none", True, None),
        (AUTO, "none", False, None),
        (AUTO, "auto", False, None),
        (AUTO, "required", False, None),
        (AUTO, NAMED, False, None),
    ],
)
def test_what_is_not_served_is_a_message_naming_it(
    tools: ToolCalling, choice: Any, stream: bool, says: str | None
) -> None:
    refused = tools.refusal(choice, stream)
    assert refused is None if says is None else says in refused


def test_tools_are_served_fields_as_vllm_hands_them_to_the_template() -> None:
    body = ChatRequest.model_validate({**CHAT, "tools": [{"function": {"name": "f"}}]})
    assert body.tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    ]
    assert body.tool_choice_value == "auto"  # tools without a choice: "auto", as OpenAI
    assert ChatRequest.model_validate({**CHAT, "tools": []}).tools is None
    with pytest.raises(ValidationError, match="invalid tool"):
        ChatRequest.model_validate({**CHAT, "tools": [{"function": {}}]})
    with pytest.raises(ValidationError, match="`tools` must be set"):
        ChatRequest.model_validate({**CHAT, "tool_choice": "auto"})
    with pytest.raises(ValidationError, match="tool_choice"):
        ChatRequest.model_validate({**CHAT, "tools": [TOOL], "tool_choice": "sometimes"})
    other = {"type": "function", "function": {"name": "send_mail"}}
    with pytest.raises(ValidationError, match="does not match any of the specified `tools`"):
        ChatRequest.model_validate({**CHAT, "tools": [TOOL], "tool_choice": other})
    named = ChatRequest.model_validate({**CHAT, "tools": [TOOL], "tool_choice": NAMED})
    assert named.tool_choice_value == NAMED


def test_tool_messages_keep_their_tool_fields() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "result", "tool_call_id": "c1"},
    ]
    body = ChatRequest.model_validate({**CHAT, "messages": messages})
    assistant, tool = (m.message() for m in body.messages[1:])
    assert assistant.tool_calls == [call] and assistant.content == ""
    assert tool.tool_call_id == "c1" and tool.segments()[0].kind == "data"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def _tools() -> list[dict[str, Any]]:
    return ChatRequest.model_validate({**CHAT, "tools": [TOOL]}).tools or []


@pytest.fixture(scope="module")
def hermes(tokenizer: Any) -> Any:
    """vLLM's composed parser class for ``--enable-auto-tool-choice --tool-call-parser
    hermes``, checked against the tiny tokenizer."""
    return AUTO.parser_class(tokenizer)


def test_hermes_calls_in_model_text_become_openai_tool_calls(tokenizer: Any, hermes: Any) -> None:
    reader = ToolCallReader(hermes, tokenizer, _tools())
    text = (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n'
        "</tool_call>"
    )
    content, calls, finish = reader.read(text, "stop")
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert calls is not None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"},
        {"city": "Lyon"},
    ]
    assert all(c["type"] == "function" and c["id"] for c in calls)
    first_only = ToolCallReader(hermes, tokenizer, _tools(), parallel_tool_calls=False)
    assert len(first_only.read(text, "stop")[1] or ()) == 1
    plain = ToolCallReader(hermes, tokenizer, _tools())
    assert plain.read("It is sunny.", "length") == ("It is sunny.", None, "length")


def test_required_and_named_calls_are_constrained_and_read_as_vllm_does(
    tokenizer: Any, hermes: Any
) -> None:
    from vllm import SamplingParams

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for choice, stops_after_first, finish in [
        ("required", False, "tool_calls"),
        (NAMED, True, "stop"),
    ]:
        reader = ToolCallReader(hermes, tokenizer, _tools(), tool_choice=choice)
        params = SamplingParams(max_tokens=8, structured_outputs=None)
        reader.adjust(params)
        # vLLM's structural tag: the answer is one (or more) Hermes call of get_weather
        tag = json.loads(params.structured_outputs.structural_tag)["format"]
        assert tag["at_least_one"] and tag["stop_after_first"] is stops_after_first
        assert tag["tags"][0]["begin"].startswith('<tool_call>\n{"name": "get_weather"')
        content, calls, finished = reader.read(call, "stop")
        assert (content, finished) == ("", finish)  # a named call finishes as the engine says
        assert [json.loads(c["function"]["arguments"]) for c in calls or ()] == [{"city": "Paris"}]
        nothing = ToolCallReader(hermes, tokenizer, _tools(), tool_choice=choice)
        assert nothing.read("no call", "length") == ("no call", [], "length")
    auto = ToolCallReader(hermes, tokenizer, _tools())
    params = SamplingParams(max_tokens=8)
    auto.adjust(params)
    assert params.structured_outputs is None  # "auto" is not constrained (no response_format)


def test_a_request_with_tools_is_rendered_with_them() -> None:
    from guardrail.integrations.serving import _guard_request

    body = ChatRequest.model_validate({**CHAT, "tools": [TOOL]})
    request = _guard_request(body, None)
    assert isinstance(request, ChatWithTools)
    assert request.tools == body.tools
    assert request.messages[0].content == "Weather in Paris?"
