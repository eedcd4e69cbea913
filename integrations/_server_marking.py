"""A server-side rule that marks untrusted data without changing clients.

A RAG application that pastes retrieved documents into the user message between delimiters it
chooses (``<documents> ... </documents>``) can be guarded with no client change:
``guardrail-serve --data-between '<documents>' '</documents>'`` marks that text as data in every
message (in a completion's prompt too).

The rule is built so that the data cannot move its own boundary: the data region runs from the
**first** opening delimiter to the end of the **last** closing one in the message, delimiters
included. A document that contains a closing delimiter followed by "ignore previous
instructions" therefore stays data; the price is that text an application puts between two
delimited regions counts as data too (a lower focus: the conservative side). A message with an
opening delimiter and no closing one after it (also after the last closing one) is data from
the first opening delimiter to its end.

Example:
    >>> rule = DelimitedData("<doc>", "</doc>")
    >>> [(s.kind, s.text) for s in rule.segments("Sum up: <doc>a</doc> now", "instruction")]
    [('instruction', 'Sum up: '), ('data', '<doc>a</doc>'), ('instruction', ' now')]
"""

from __future__ import annotations

from dataclasses import dataclass

from guardrail.probe.prompts import Message, Segment, SpanKind

__all__ = ["DelimitedData"]


@dataclass(frozen=True)
class DelimitedData:
    """Text from the first ``start`` to the end of the last ``end`` of a message is data."""

    start: str
    end: str

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("data delimiters must be non-empty strings")

    def segments(self, text: str, kind: SpanKind) -> list[Segment]:
        """``text`` (of a message whose kind is ``kind``) split into segments."""
        first = text.find(self.start)
        if kind == "data" or first < 0:
            return [Segment(text=text, kind=kind)]
        last = text.rfind(self.end)
        stop = last + len(self.end) if last >= first + len(self.start) else len(text)
        if text.find(self.start, stop) >= 0:  # opened again and never closed: data to the end
            stop = len(text)
        pieces = [(text[:first], kind), (text[first:stop], "data"), (text[stop:], kind)]
        return [Segment(text=t, kind=k) for t, k in pieces if t]  # type: ignore[arg-type]

    def apply(self, message: Message) -> Message:
        """``message`` with the rule applied to each segment it holds."""
        before = message.segments()
        after = [piece for s in before for piece in self.segments(s.text, s.kind)]
        if not after or [(s.text, s.kind) for s in after] == [(s.text, s.kind) for s in before]:
            return message
        return Message(  # the tool fields kept: template input, not content
            role=message.role,
            content=after,
            tool_calls=message.tool_calls,
            tool_call_id=message.tool_call_id,
        )
