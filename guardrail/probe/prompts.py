"""Requests with trust marked, rendered through the model's chat template into token spans.

The probe needs to know which prompt tokens are the trusted instruction and which are untrusted
data. Spans are computed on the final token ids, after the chat template, from the tokenizer's
character offsets, never from hard-coded positions.

Accepted request forms:
- ``"plain text"``: one trusted user message (no data, so nothing to be distracted by);
- ``("instruction", "data")`` or ``GuardedPrompt(instruction=..., data=...)``: the instruction as
  the system message, the data in the user message after a neutral ``"Data: "`` prefix;
- a list of chat messages (dicts or ``Message``): system/user/developer are trusted, any other
  role (tool, document, ...) is data; ``trusted=`` overrides, and a message's content may be a
  list of ``Segment`` to mix trusted text with untrusted data inside one message.

Example:
    >>> GuardedPrompt(instruction="Summarize the email.", data="Hi Bob, ...").data
    'Hi Bob, ...'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from guardrail.errors import RequestError

SpanKind = Literal["instruction", "data", "other"]
TRUSTED_ROLES = frozenset({"system", "user", "developer"})


class Segment(BaseModel):
    """A piece of a message's content with its role for the probe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    kind: SpanKind


class Message(BaseModel):
    """A chat message; ``trusted`` defaults from the role (system/user/developer are trusted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(min_length=1)
    content: str | list[Segment]
    trusted: bool | None = None

    def segments(self) -> list[Segment]:
        if isinstance(self.content, list):
            return self.content
        trusted = self.role in TRUSTED_ROLES if self.trusted is None else self.trusted
        return [Segment(text=self.content, kind="instruction" if trusted else "data")]


class GuardedPrompt(BaseModel):
    """A trusted instruction and the untrusted data it works on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instruction: str = Field(min_length=1)
    data: str = ""
    data_prefix: str = "Data: "

    def messages(self) -> list[Message]:
        user = [Segment(text=self.data_prefix, kind="other"), Segment(text=self.data, kind="data")]
        return [
            Message(role="system", content=[Segment(text=self.instruction, kind="instruction")]),
            Message(role="user", content=user),
        ]


RequestLike = str | tuple[str, str] | GuardedPrompt | Sequence[Message | dict[str, Any]]


@dataclass(frozen=True)
class PreparedPrompt:
    """What the engine runs and the probe reads: token ids and half-open token spans."""

    token_ids: list[int]
    instruction_spans: list[tuple[int, int]]
    data_spans: list[tuple[int, int]]
    text: str
    segments: tuple[Segment, ...] = ()  # the request's content, in order, as the caller marked it

    @property
    def num_data_tokens(self) -> int:
        """How many prompt tokens are untrusted data (the data spans' total length)."""
        return sum(end - start for start, end in self.data_spans)


def to_messages(request: RequestLike) -> list[Message]:
    """Normalise any accepted request form to messages; ``RequestError`` says what was wrong."""
    try:
        if isinstance(request, str):
            if not request.strip():
                raise RequestError("empty prompt: send some text")
            return [Message(role="user", content=request)]
        if isinstance(request, GuardedPrompt):
            return request.messages()
        if isinstance(request, tuple) and len(request) == 2:
            instruction, data = request
            if not isinstance(instruction, str) or not isinstance(data, str):
                raise RequestError("an (instruction, data) request needs two strings")
            return GuardedPrompt(instruction=instruction, data=data).messages()
        if isinstance(request, Sequence) and request and not isinstance(request, bytes):
            return [m if isinstance(m, Message) else Message.model_validate(m) for m in request]
    except ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from exc
    raise RequestError(
        f"unsupported request of type {type(request).__name__}: send a string, an (instruction, "
        "data) tuple, a GuardedPrompt, or a non-empty list of chat messages"
    )


def request_segments(request: RequestLike) -> tuple[Segment, ...]:
    """The request's content in order, as marked (empty for a request that is not valid: the
    engine reports that one).

    Example:
        >>> [s.kind for s in request_segments(("Summarize.", "Hi"))]
        ['instruction', 'other', 'data']
    """
    try:
        return tuple(s for m in to_messages(request) for s in m.segments())
    except RequestError:
        return ()


def _render(messages: list[Message], tokenizer: Any) -> tuple[str, list[tuple[int, int, SpanKind]]]:
    """Render the chat template; return the text and each segment's character range."""
    plain = [{"role": m.role, "content": "".join(s.text for s in m.segments())} for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    ranges: list[tuple[int, int, SpanKind]] = []
    cursor = 0
    for message, rendered in zip(messages, plain, strict=True):
        start = text.find(rendered["content"], cursor)
        if start < 0:
            raise RequestError(
                f"the chat template changed the content of a {message.role!r} message (e.g. "
                "stripped whitespace), so its tokens cannot be located; strip the content first"
            )
        for segment in message.segments():
            ranges.append((start, start + len(segment.text), segment.kind))
            start += len(segment.text)
        cursor = start
    return text, ranges


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def prepare_prompt(
    request: RequestLike, tokenizer: Any, max_tokens: int | None = None
) -> PreparedPrompt:
    """Render ``request`` with the model's chat template and compute its token spans.

    A token belongs to the segment that holds its last character (byte-level BPE glues a
    leading space to the next word, so a token straddling a boundary belongs to the word).

    Example:
        >>> p = prepare_prompt(("Translate to French.", "Hello"), tokenizer)  # doctest: +SKIP
        >>> p.data_spans  # doctest: +SKIP
        [(17, 18)]
    """
    messages = to_messages(request)
    if not any(s.text.strip() for m in messages for s in m.segments() if s.kind == "instruction"):
        raise RequestError(
            "the request has no trusted instruction text: add a system or user "
            "message, or an instruction"
        )
    text, ranges = _render(messages, tokenizer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    token_ids = list(encoded["input_ids"])
    if not token_ids:
        raise RequestError("the request rendered to zero tokens")
    if max_tokens is not None and len(token_ids) >= max_tokens:
        raise RequestError(
            f"the request has {len(token_ids)} prompt tokens but the engine's context is "
            f"{max_tokens} tokens (max_model_len), leaving no room to generate: shorten the "
            "data or start the engine with a larger max_model_len"
        )
    kinds: list[SpanKind] = []
    for start, end in encoded["offset_mapping"]:
        last = end - 1 if end > start else start
        kind: SpanKind = "other"
        for lo, hi, k in ranges:
            if lo <= last < hi and end > start:
                kind = k
                break
        kinds.append(kind)
    return PreparedPrompt(
        token_ids=token_ids,
        instruction_spans=_runs([k == "instruction" for k in kinds]),
        data_spans=_runs([k == "data" for k in kinds]),
        text=text,
        segments=tuple(s for m in messages for s in m.segments()),
    )


def _occurrences(text: str, values: Iterable[str]) -> list[tuple[int, int]]:
    """Merged, sorted character ranges of every occurrence of every value in ``text``."""
    ranges: list[tuple[int, int]] = []
    for value in values:
        for needle in dict.fromkeys((value, value.strip())):  # a template may strip the value
            start = text.find(needle) if needle else -1
            while start >= 0:
                ranges.append((start, start + len(needle)))
                start = text.find(needle, start + 1)
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def mark_untrusted(
    text: str, values: Iterable[str], kind: SpanKind = "instruction"
) -> list[Segment]:
    """Split ``text`` into segments: occurrences of ``values`` are "data", the rest ``kind``.

    Overlapping or adjacent occurrences merge into one data segment; blank values are ignored.

    Example:
        >>> [s.kind for s in mark_untrusted("a X b X", ["X"])]
        ['instruction', 'data', 'instruction', 'data']
    """
    segments: list[Segment] = []
    cursor = 0
    for lo, hi in _occurrences(text, [v for v in values if v.strip()]):
        if lo > cursor:
            segments.append(Segment(text=text[cursor:lo], kind=kind))
        segments.append(Segment(text=text[lo:hi], kind="data"))
        cursor = hi
    if cursor < len(text) or not segments:
        segments.append(Segment(text=text[cursor:], kind=kind))
    return segments
