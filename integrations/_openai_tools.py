"""OpenAI tool calling for ``guardrail-serve``, with the meaning ``vllm serve`` gives it.

The request's ``tools`` reach the chat template (``guardrail.probe.prompts.ChatWithTools``:
the application's definitions are template markup, span kind "other"; tool results stay data).
What the model writes is read by vLLM's own tool parser (``--tool-call-parser NAME``, e.g.
``hermes``), and calls come back as ``message.tool_calls`` with ``finish_reason
"tool_calls"``, as ``vllm serve`` answers a non-streamed request. The guard's verdict is given
before any of it: a blocked request is a 403 whatever it asked.

Served: ``tool_choice`` ``"none"`` (tools rendered, the answer is text) and ``"auto"`` (with
``--enable-auto-tool-choice --tool-call-parser NAME``, as ``vllm serve`` needs them);
``parallel_tool_calls: false`` keeps the first call. Refused with a 400 naming them:
``"required"`` and a named function (``vllm serve`` constrains those with structural tags this
server does not build), and ``stream: true`` with tools that may be called (this server does not
stream tool-call deltas).

Example:
    >>> ToolCalling(enable_auto_tool_choice=False).refusal("auto", stream=False)
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from guardrail.errors import ConfigError

__all__ = ["ToolCallReader", "ToolCalling", "normalised_tools"]


@dataclass(frozen=True)
class ToolCalling:
    """The server's tool flags, as ``vllm serve`` takes them: ``--enable-auto-tool-choice`` and
    ``--tool-call-parser NAME`` (a parser vLLM registers, e.g. ``hermes``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser is not None:
            from vllm.tool_parsers import ToolParserManager

            known = ToolParserManager.list_registered()
            if self.tool_call_parser not in known:
                raise ConfigError(
                    f"invalid tool call parser: {self.tool_call_parser} (choose from "
                    f"{', '.join(known)})"
                )

    @property
    def auto(self) -> bool:
        """Whether ``tool_choice: "auto"`` is served (both flags given)."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def refusal(self, tool_choice: Any, stream: bool) -> str | None:
        """The message of the 400 for a request with tools and this ``tool_choice`` (None: the
        default, "auto" with tools), or None when it is served."""
        if tool_choice == "none":
            return None
        if tool_choice == "required" or isinstance(tool_choice, dict):
            value = tool_choice if tool_choice == "required" else "a named function"
            return (
                f'tool_choice {value!r} is not served by guardrail-serve ("auto" and "none" '
                "are): vllm serve constrains the answer to a call, which this server does not"
            )
        if not self.auto:  # vLLM's own message (vllm/renderers/online_renderer.py)
            return (
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        if stream:
            return (
                "stream: true with tools is not served by guardrail-serve (tool-call deltas "
                'are not streamed): send stream: false, or tool_choice: "none"'
            )
        return None


def normalised_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """``tools`` validated and dumped by vLLM's own request model, as ``vllm serve`` hands them
    to the chat template (``{"type": "function", "function": {"name", "description",
    "parameters"}}``, absent fields None). Raises ``ValueError`` for a malformed tool."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    return [ChatCompletionToolsParam.model_validate(tool).model_dump() for tool in tools]


@dataclass(frozen=True)
class ToolCallReader:
    """One request's reading of tool calls: vLLM's tool parser ``parser_name`` over the
    generated text, for the request's ``tools`` (made per request; holds nothing else).

    Example:
        >>> reader = ToolCallReader("hermes", tokenizer, tools)  # doctest: +SKIP
        >>> reader.read('<tool_call>{"name": "f", "arguments": {}}</tool_call>')  # doctest: +SKIP
        (None, [{'id': 'chatcmpl-tool-...', 'type': 'function', 'function': {...}}])
    """

    parser_name: str
    tokenizer: Any
    tools: list[dict[str, Any]]
    parallel_tool_calls: bool | None = None

    def _parser_and_request(self) -> tuple[Any, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        request = ChatCompletionRequest.model_validate(
            {
                "messages": [{"role": "user", "content": ""}],
                "tools": self.tools,
                "tool_choice": "auto",
                "parallel_tool_calls": self.parallel_tool_calls,
            }
        )
        tools: Any = request.tools
        parser = ToolParserManager.get_tool_parser(self.parser_name)(self.tokenizer, tools)
        return parser, request

    def skip_special_tokens(self, default: bool) -> bool:
        """Whether the engine's detokenizer may drop special tokens: the parser says (Hermes
        needs ``<tool_call>`` kept where a model marks it special), as its
        ``adjust_request`` tells ``vllm serve``."""
        parser, request = self._parser_and_request()
        request.skip_special_tokens = default
        return bool(parser.adjust_request(request).skip_special_tokens)

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's content and tool calls (OpenAI's form: ``{"id", "type": "function",
        "function": {"name", "arguments"}}``) in the generated ``text``; no calls:
        ``(text, [])``. ``parallel_tool_calls=False`` keeps the first call, as ``vllm serve``
        does."""
        parser, request = self._parser_and_request()
        found = parser.extract_tool_calls(text, request)
        if not found.tools_called or not found.tool_calls:
            return text, []
        calls = [call.model_dump() for call in found.tool_calls]
        if self.parallel_tool_calls is False:
            calls = calls[:1]
        return found.content, calls
