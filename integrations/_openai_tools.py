"""OpenAI tool calling for ``guardrail-serve``, with the meaning ``vllm serve`` gives it.

The request's ``tools`` reach the chat template (``guardrail.probe.prompts.ChatWithTools``:
the application's definitions are template markup, span kind "other"; tool results stay data).
With ``--enable-auto-tool-choice --tool-call-parser NAME`` (e.g. ``hermes``), as ``vllm serve``
needs them, what the model writes is read by vLLM's own tool parser, and calls come back as
``message.tool_calls`` as ``vllm serve`` answers a non-streamed request. The guard's verdict is
given before any of it: a blocked request is a 403 whatever it asked.

``tool_choice``, as ``vllm serve`` (``vllm/entrypoints/openai/chat_completion/serving.py``):

- ``"none"``: tools rendered, the answer is text (no flags needed);
- ``"auto"`` (the default with tools): the parser reads calls from the text; ``finish_reason``
  ``"tool_calls"`` when it found some;
- ``"required"`` and a named function: vLLM's structured outputs constrain the answer to a
  call (the structural tag or JSON schema vLLM's parser builds from the tools in its
  ``adjust_request``), read back as calls; ``finish_reason`` ``"tool_calls"`` for
  ``"required"`` (when the answer ended), the engine's for a named function.

Requests are adjusted and answers read by vLLM's own composed parser
(``vllm.parser.ParserManager.get_parser``, the class ``vllm serve`` builds from the same flags),
so the grammar and the reading are vLLM's, not a copy.

``parallel_tool_calls: false`` keeps the first call. ``stream: true`` with any ``tool_choice``
but ``"none"`` is refused with a 400 naming it (tool-call deltas are not streamed).

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
        """Whether tools may be called (both flags given)."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def parser_class(self, tokenizer: Any) -> Any:
        """vLLM's composed parser class for these flags, checked against the served model's
        ``tokenizer`` as ``vllm serve`` checks it at start-up (None without both flags).
        Raises ``ConfigError`` when the parser cannot read this tokenizer."""
        if not self.auto:
            return None
        from vllm.parser import ParserManager

        try:
            return ParserManager.get_parser(
                tool_parser_name=self.tool_call_parser,
                enable_auto_tools=True,
                tokenizer=tokenizer,
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser}: {exc}") from None

    def refusal(self, tool_choice: Any, stream: bool) -> str | None:
        """The message of the 400 for a request with tools and this ``tool_choice`` ("auto"
        when none was given; a named function as its object), or None when it is served."""
        if tool_choice == "none":
            return None
        if not self.auto:  # vLLM's own messages (vllm/renderers/online_renderer.py)
            if tool_choice == "auto":
                return (
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set"
                )
            described = (
                f'function "{tool_choice["function"]["name"]}"'
                if isinstance(tool_choice, dict)
                else f'"{tool_choice}"'
            )
            return (
                f"tool_choice={described} requires --tool-call-parser to be set "
                "(guardrail-serve: with --enable-auto-tool-choice)"
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


class ToolCallReader:
    """One request's tool calling through vLLM's parser (``ToolCalling.parser_class``): the
    request's ``tools`` and ``tool_choice`` ("auto", "required" or a named function's object).
    Made per request (vLLM's parsers hold per-request state), never shared.

    Example:
        >>> reader = ToolCallReader(parser_class, tokenizer, tools)  # doctest: +SKIP
        >>> reader.adjust(sampling_params)  # doctest: +SKIP
        >>> reader.read('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop")
        ... # doctest: +SKIP
        (None, [{'id': 'chatcmpl-tool-...', 'type': 'function', 'function': {...}}], 'tool_calls')
    """

    def __init__(
        self,
        parser_class: Any,
        tokenizer: Any,
        tools: list[dict[str, Any]],
        parallel_tool_calls: bool | None = None,
        tool_choice: Any = "auto",
    ) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.tool_choice = tool_choice
        self.parallel_tool_calls = parallel_tool_calls
        self.request = ChatCompletionRequest.model_validate(
            {
                "messages": [{"role": "user", "content": ""}],
                "tools": tools,
                "tool_choice": tool_choice,
                "parallel_tool_calls": parallel_tool_calls,
            }
        )
        self.parser = parser_class(tokenizer, self.request.tools)

    def adjust(self, params: Any) -> None:
        """Set vLLM ``SamplingParams`` as vLLM's parser adjusts a request for ``vllm serve``:
        whether special tokens are kept (Hermes keeps ``<tool_call>``) and the constraint that
        makes "required" or a named function a call (it takes the place of a
        ``response_format``'s, which "auto" keeps, as in vLLM)."""
        self.request.skip_special_tokens = params.skip_special_tokens
        self.request.structured_outputs = params.structured_outputs
        self.request = self.parser.adjust_request(self.request)
        params.skip_special_tokens = bool(self.request.skip_special_tokens)
        params.structured_outputs = self.request.structured_outputs

    def read(
        self, text: str, finish: str | None
    ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """The answer's content, tool calls (OpenAI's form: ``{"id", "type": "function",
        "function": {"name", "arguments"}}``; None: the message has no ``tool_calls``) and
        ``finish_reason``, from the generated ``text`` and the engine's ``finish``, as
        ``vllm serve``'s non-streamed answer has them."""
        from vllm.entrypoints.generate.base.protocol import ToolCall

        _, content, found = self.parser.parse(text, self.request, enable_auto_tools=True)
        # as vllm serve: the parser's id, or a fresh one
        calls = [
            ToolCall(function=c, **({"id": c.id} if c.id else {})).model_dump() for c in found or ()
        ]
        if self.parallel_tool_calls is False:
            calls = calls[:1]
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        if forced:
            ended = self.tool_choice == "required" and finish == "stop"
            return content or "", calls, "tool_calls" if ended else finish
        if not calls:
            return content, None, finish
        return content, calls, "tool_calls"
