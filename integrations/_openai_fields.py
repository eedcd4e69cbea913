"""Which fields of an OpenAI request the guarded server serves, and which it refuses.

An application that sends ``tools`` or ``logit_bias`` and gets a plausible plain answer back,
without tool calls or the bias, is worse off than one that gets a 400: so no field is ignored
silently.
Every field of the OpenAI chat and completions requests is in exactly one of three sets (a test
enumerates the ``openai`` package's request types against them):

- ``SERVED``: honoured with the meaning OpenAI and ``vllm serve`` give it (vLLM's sampling
  extras ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos`` too; ``logprobs`` is
  a boolean in a chat, with ``top_logprobs``, and a number in a completion; ``tools``,
  ``tool_choice`` "none" and "auto" and ``parallel_tool_calls``, as ``_openai_tools`` says);
- ``NO_EFFECT``: bookkeeping fields that change nothing in the answer, accepted as ``vllm
  serve`` accepts them (``user``, ``metadata``, ``store``, ...);
- ``REFUSED``: not served yet (logit_bias, audio, echo, ...): a request that
  sets one to anything but its "off" value is a 400 naming the field. A field in none of the
  sets is refused too.

Example:
    >>> refused_field({"model": "m", "logit_bias": {"42": 5}})
    'logit_bias'
    >>> refused_field({"model": "m", "audio": None, "logit_bias": {}, "user": "u"}) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NO_EFFECT", "REFUSED", "SERVED", "refused_field"]

SERVED = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "data",  # the guardrail's own: untrusted data of a completion
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",  # 1 only
        "stream",
        "stream_options",
        "frequency_penalty",
        "presence_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "response_format",  # text, json_object, json_schema: vLLM's structured outputs
        "logprobs",  # chat: true / false; completions: how many most likely tokens
        "top_logprobs",  # chat
        "tools",  # chat: rendered by the template, calls read by vLLM's tool parser
        "tool_choice",  # "none"; the others with --enable-auto-tool-choice --tool-call-parser
        "parallel_tool_calls",
    }
)
NO_EFFECT = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)
REFUSED = frozenset(
    {
        "functions",
        "function_call",
        "logit_bias",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "moderation",
        "best_of",
        "echo",
        "suffix",
    }
)

_OFF: dict[str, tuple[Any, ...]] = {
    "modalities": (["text"],),
    "best_of": (1,),
}
"""Values of a refused field that ask for nothing (besides None, False, "" and empty lists and
objects): an SDK that sends them gets the plain answer it asked for."""


def refused_field(body: Mapping[str, Any]) -> str | None:
    """The first field of ``body`` (a request's JSON object) this server does not serve, or
    None. A refused field set to its "off" value (None, False, empty, ``_OFF``) is accepted."""
    for name, value in body.items():
        if name in SERVED or name in NO_EFFECT:
            continue
        if name in REFUSED and (
            value is None or value is False or value in ("", [], {}) or value in _OFF.get(name, ())
        ):
            continue
        return name
    return None
