"""Generated tokens' logprobs in OpenAI's two response shapes, from the engine's
``PositionLogprobs`` (one per generated token: the token's own entry, then the N most likely).

- chat (``logprobs: true``, ``top_logprobs: N``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``, one entry per token;
- completions (``logprobs: N``, the legacy shape): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, each ``top_logprobs`` entry mapping token text to logprob
  for the generated token and the N most likely, ``text_offset`` each token's start in the
  concatenated token texts (a stream's chunks continue where the previous one ended).

Rendered as ``vllm serve`` renders them (``OpenAIServingChat._create_chat_logprobs``,
``OpenAIServingCompletion._create_completion_logprobs``): a token's text is vLLM's text of that
token alone (``Logprob.decoded_token``; ``token_id:ID``, vLLM's placeholder, when it has none),
``bytes`` its UTF-8 encoding, and a logprob is never below -9999.0 (what OpenAI sends for
-inf). One difference, on purpose: a chat's ``top_logprobs`` are the N most likely tokens in
rank order, as OpenAI defines them. vLLM lists its stored entries in their order, the generated
token first, so when sampling picks a token outside the N most likely, its list holds that token
and drops the Nth; under greedy decoding both lists are the same.

Example:
    >>> from guardrail.engine.types import TokenLogprob
    >>> hi, yo = TokenLogprob(7, -0.1, 1, "hi"), TokenLogprob(9, -2.5, 2, "yo")
    >>> chat_logprobs([7], [(hi, yo)], top=1)["content"][0]["top_logprobs"]
    [{'token': 'hi', 'logprob': -0.1, 'bytes': [104, 105]}]
    >>> legacy = completion_logprobs([9, 7], [(yo, hi), (hi, yo)], top=1)
    >>> legacy["tokens"], legacy["top_logprobs"], legacy["text_offset"]
    (['yo', 'hi'], [{'yo': -2.5, 'hi': -0.1}, {'hi': -0.1}], [0, 2])
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from guardrail.engine.types import PositionLogprobs, TokenLogprob

__all__ = ["FLOOR", "RequestLogprobs", "chat_logprobs", "completion_logprobs"]

FLOOR = -9999.0
"""The lowest logprob sent: OpenAI's (and vLLM's) stand-in for -inf, which JSON cannot hold."""


def _text(entry: TokenLogprob) -> str:
    return entry.token if entry.token is not None else f"token_id:{entry.token_id}"


def _positions(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs] | None
) -> Iterator[tuple[int, TokenLogprob | None, PositionLogprobs]]:
    """Each token id, its own entry (None when the engine returned none), and its position."""
    given = list(positions or ())
    for i, token_id in enumerate(token_ids):
        position = given[i] if i < len(given) else ()
        own = next((e for e in position if e.token_id == token_id), None)
        yield token_id, own, position


def _most_likely(position: PositionLogprobs, top: int) -> list[TokenLogprob]:
    """The ``top`` most likely entries of a position, by rank (``top`` -1: all)."""
    ranked = sorted(position, key=lambda e: math.inf if e.rank is None else e.rank)
    return ranked if top == -1 else ranked[:top]


def _chat_entry(entry: TokenLogprob) -> dict[str, Any]:
    text = _text(entry)
    return {
        "token": text,
        "logprob": max(entry.logprob, FLOOR),
        "bytes": list(text.encode("utf-8", errors="replace")),
    }


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs] | None, top: int
) -> dict[str, Any]:
    """A chat choice's ``logprobs``: one entry per token of ``token_ids``, each with its ``top``
    most likely alternatives."""
    content = []
    for token_id, own, position in _positions(token_ids, positions):
        if own is None:  # as vLLM: the floor, no alternatives
            content.append({**_chat_entry(TokenLogprob(token_id, FLOOR)), "top_logprobs": []})
            continue
        alternatives = [_chat_entry(e) for e in _most_likely(position, top)]
        content.append({**_chat_entry(own), "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs] | None,
    top: int,
    text_offset: int = 0,
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (the legacy shape), its first token at
    ``text_offset``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, own, position in _positions(token_ids, positions):
        text = _text(own or TokenLogprob(token_id, FLOOR))
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if own is None:  # as vLLM: no logprob for a token the engine returned none for
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(max(own.logprob, FLOOR))
        tops.append({_text(e): max(e.logprob, FLOOR) for e in [own, *_most_likely(position, top)]})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@dataclass
class RequestLogprobs:
    """How one request's logprobs are rendered: the chat or the completions shape, with ``top``
    most likely tokens per position. A completion's stream continues its text offsets from
    chunk to chunk, so one of these lives as long as its request.

    Example:
        >>> from guardrail.engine.types import TokenLogprob
        >>> stream = RequestLogprobs(chat=False, top=0)
        >>> [stream.render([7], [(TokenLogprob(7, -0.1, 1, "hi"),)])["text_offset"]
        ...  for _ in range(2)]
        [[0], [2]]
    """

    chat: bool
    top: int
    text_offset: int = 0

    def render(
        self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs] | None
    ) -> dict[str, Any]:
        """The ``logprobs`` of a choice (or a stream chunk) holding ``token_ids``."""
        if self.chat:
            return chat_logprobs(token_ids, positions, self.top)
        rendered = completion_logprobs(token_ids, positions, self.top, self.text_offset)
        self.text_offset += sum(len(token) for token in rendered["tokens"])
        return rendered
