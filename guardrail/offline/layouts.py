"""Prompt layouts: one labelled row rendered the ways real applications put data in a prompt.

The probe reads attention over the instruction and data spans, and the same data scores
differently depending on where it sits (after a system instruction, inside a RAG system
message, in a tool result, split into retrieved chunks...). Calibrating and evaluating on the
``pair`` form alone measures one layout; these layouts render a ``LabelledPair`` the ways the
adapters produce in service, so both can cover them:

- ``pair``: today's form, ``GuardedPrompt(instruction, data)``: system = the instruction, user =
  ``"Data: "`` + the data;
- ``user_message``: one user message, the instruction then the data (a chat client pasting a
  document under its request; no system message, as many clients send none);
- ``tool``: an agent turn: a generic agent system prompt, the instruction as the user's request,
  an assistant tool call, then a ``tool`` message whose content is the data as the tool returned
  it (the OpenAI-compatible server marks tool messages as data);
- ``tool_json``: the same, the tool result being JSON: ``{"result": <the data>}``;
- ``rag_system``: the LangChain RAG template of docs/langchain.md: system = a trusted preamble
  ending in ``Context:`` followed by the data, then the instruction as the user's question;
- ``multi_segment``: retrieved chunks: the data split into 2-4 documents (paragraph, line,
  sentence or word boundaries, as text splitters cut), each its own data segment between
  trusted ``Document i:`` separators, after the instruction in one user message;
- ``multi_turn``: an earlier user/assistant exchange, then the instruction and data in one user
  message.

Text the application writes around the data (``Context:``, ``Document 2:``) is trusted
instruction, as the LangChain adapter marks it (``mark_untrusted``). Assistant turns are left as
both adapters mark them by default: a role other than system/user/developer, so untrusted data.
An injected row's ``attack`` always stays whole inside one data segment (``multi_segment``
never cuts inside it; ``tool_json`` JSON-escapes it with the rest of the data).

Rendering is deterministic: the few choices a layout makes (a tool name, the number of chunks,
the earlier exchange) are drawn from a hash of the row's group, so a clean row and its injected
twins are rendered alike and differ by the attack alone.

Example:
    >>> row = LabelledPair("r1", "Summarize the email.", "Hi Bob. Lunch at noon?", 0)
    >>> [m.role for m in render(row, "tool")]
    ['system', 'user', 'assistant', 'tool']
    >>> rows = with_layouts([row], ["pair", "rag_system"])
    >>> [(r.id, r.extra["layout"], r.group == row.group) for r in rows]
    [('r1~pair', 'pair', True), ('r1~rag_system', 'rag_system', True)]
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import replace

from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair
from guardrail.probe.prompts import GuardedPrompt, Message, RequestLike, Segment

__all__ = [
    "LAYOUTS",
    "render",
    "request_for",
    "split_documents",
    "with_drawn_layouts",
    "with_layouts",
]

LAYOUTS: tuple[str, ...] = (
    "pair",
    "user_message",
    "tool",
    "tool_json",
    "rag_system",
    "multi_segment",
    "multi_turn",
)
"""Layout names, in the order ``with_layouts`` documents them."""

AGENT_SYSTEM = (
    "You are a helpful assistant with access to tools. Call a tool when you need information, "
    "then use its result to complete the user's request."
)
RAG_PREAMBLE = "Use only the context below to answer the user's request.\n\nContext:\n"
CHAT_SYSTEM = "You are a helpful assistant."
_TOOLS = (  # name, argument, value format (filled from the row's group)
    ("fetch_document", "doc_id", "doc-{n}"),
    ("read_file", "path", "shared/files/{n}.txt"),
    ("search", "query", "item {n}"),
    ("get_record", "record_id", "{n}"),
)
_EARLIER_TURNS = (
    ("Hi! I have a few things to get through today, can you help?", "Of course. What's first?"),
    (
        "What's a good way to keep notes from meetings organised?",
        "Keep one running document per "
        "project, date each entry, and put action items at the top with an owner for each.",
    ),
    ("Thanks for the help earlier.", "You're welcome! Send over the next thing when ready."),
)
# Where text splitters cut, coarsest first: paragraphs, lines, sentences, words.
_BOUNDARIES = (
    re.compile(r"\s*\n[ \t]*\n\s*"),
    re.compile(r"[ \t]*\n\s*"),
    re.compile(r"(?<=[.!?])\s+"),
    re.compile(r"\s+"),
)


def _draw(pair: LabelledPair, salt: str, n: int) -> int:
    """A number in ``range(n)`` from the row's group (stable across runs and machines)."""
    digest = hashlib.sha256(f"{salt}\0{pair.group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % n


def _unknown(layout: str) -> ConfigError:
    return ConfigError(f"unknown layout {layout!r}: choose from {', '.join(LAYOUTS)}")


def _occurrences(text: str, needles: Iterable[str]) -> list[tuple[int, int]]:
    found = []
    for needle in needles:
        start = text.find(needle) if needle.strip() else -1
        while start >= 0:
            found.append((start, start + len(needle)))
            start = text.find(needle, start + 1)
    return found


def split_documents(data: str, parts: int, keep_whole: Sequence[str] = ()) -> list[str]:
    """``data`` cut into at most ``parts`` chunks at the coarsest boundaries that allow it.

    Boundaries are tried coarsest first (blank lines, line breaks, sentence ends, spaces); the
    first kind with enough cuts is used (else the one with the most), and the cuts nearest to
    equal lengths are chosen. The whitespace at a cut is dropped, so the chunks joined by it
    give back ``data``. No cut falls inside an occurrence of a ``keep_whole`` string (an
    injected row's attack text).

    Example:
        >>> split_documents("One. Two. Three. Four.", 2)
        ['One. Two.', 'Three. Four.']
        >>> split_documents("One. Two. Three. Four.", 2, keep_whole=["Two. Three."])
        ['One. Two. Three.', 'Four.']
    """
    if parts < 1:
        raise ConfigError(f"parts must be at least 1, got {parts}")
    protected = _occurrences(data, keep_whole)
    best: list[tuple[int, int]] = []
    for boundary in _BOUNDARIES:
        gaps = [
            (m.start(), m.end())
            for m in boundary.finditer(data)
            if m.start() > 0
            and m.end() < len(data)
            and not any(m.start() < hi and m.end() > lo for lo, hi in protected)
        ]
        if len(gaps) > len(best):
            best = gaps
        if len(gaps) >= parts - 1:
            best = gaps
            break
    chosen: set[tuple[int, int]] = set()
    for k in range(1, min(parts, len(best) + 1)):
        target = k * len(data) / parts
        free = [g for g in best if g not in chosen]
        chosen.add(min(free, key=lambda g: (abs((g[0] + g[1]) / 2 - target), g[0])))
    chunks, cursor = [], 0
    for start, end in sorted(chosen):
        chunks.append(data[cursor:start])
        cursor = end
    chunks.append(data[cursor:])
    return chunks


def _documents(pair: LabelledPair) -> list[Segment]:
    """The ``multi_segment`` user message: the instruction, then 2-4 documents."""
    keep = [pair.attack] if pair.attack else []
    chunks = split_documents(pair.data, 2 + _draw(pair, "chunks", 3), keep)
    segments = []
    for i, chunk in enumerate(chunks, 1):
        before = f"{pair.instruction}\n\n" if i == 1 else "\n\n"
        segments.append(Segment(text=f"{before}Document {i}:\n", kind="instruction"))
        segments.append(Segment(text=chunk, kind="data"))
    return segments


def _request_then_data(pair: LabelledPair) -> Message:
    return Message(
        role="user",
        content=[
            Segment(text=f"{pair.instruction}\n\n", kind="instruction"),
            Segment(text=pair.data, kind="data"),
        ],
    )


def _tool_turn(pair: LabelledPair, result: str) -> list[Message]:
    tool, argument, value = _TOOLS[_draw(pair, "tool", len(_TOOLS))]
    number = _draw(pair, "ref", 9000) + 1000
    call = {"name": tool, "arguments": {argument: value.format(n=number)}}
    return [
        Message(role="system", content=AGENT_SYSTEM),
        Message(role="user", content=pair.instruction),
        Message(role="assistant", content=json.dumps(call)),
        Message(role="tool", content=result),
    ]


def render(pair: LabelledPair, layout: str) -> list[Message]:
    """The row's request in ``layout`` (one of ``LAYOUTS``), as chat messages.

    Example:
        >>> row = LabelledPair("r1", "Translate to French.", "Good morning.", 0)
        >>> [(s.kind, s.text.split()[-1]) for s in render(row, "rag_system")[0].segments()]
        [('instruction', 'Context:'), ('data', 'morning.')]
        >>> render(row, "tool_json")[-1].content
        '{"result": "Good morning."}'
    """
    if layout == "pair":
        return GuardedPrompt(instruction=pair.instruction, data=pair.data).messages()
    if layout == "user_message":
        return [_request_then_data(pair)]
    if layout == "tool":
        return _tool_turn(pair, pair.data)
    if layout == "tool_json":
        return _tool_turn(pair, json.dumps({"result": pair.data}, ensure_ascii=False))
    if layout == "rag_system":
        system = [
            Segment(text=RAG_PREAMBLE, kind="instruction"),
            Segment(text=pair.data, kind="data"),
        ]
        return [
            Message(role="system", content=system),
            Message(role="user", content=pair.instruction),
        ]
    if layout == "multi_segment":
        return [Message(role="user", content=_documents(pair))]
    if layout == "multi_turn":
        asked, answered = _EARLIER_TURNS[_draw(pair, "turns", len(_EARLIER_TURNS))]
        return [
            Message(role="system", content=CHAT_SYSTEM),
            Message(role="user", content=asked),
            Message(role="assistant", content=answered),
            _request_then_data(pair),
        ]
    raise _unknown(layout)


def request_for(pair: LabelledPair) -> RequestLike:
    """The request to score for a row: its ``extra["layout"]`` (``"pair"`` if none).

    The ``pair`` layout stays a ``GuardedPrompt``, exactly the request scored before layouts.

    Example:
        >>> request_for(LabelledPair("r1", "Summarize.", "Hi.", 0))
        GuardedPrompt(instruction='Summarize.', data='Hi.', data_prefix='Data: ')
    """
    layout = pair.extra.get("layout", "pair")
    if layout == "pair":
        return GuardedPrompt(instruction=pair.instruction, data=pair.data)
    return render(pair, layout)


def with_layouts(pairs: Iterable[LabelledPair], layouts: Sequence[str]) -> list[LabelledPair]:
    """Each row once per layout: ``extra["layout"]`` set, the id suffixed ``~<layout>``.

    Groups are kept, so a split by group keeps every layout of a context on one side.

    Example:
        >>> row = LabelledPair("r1", "Summarize.", "Hi.", 1, group="g1", attack="Hi.")
        >>> [(r.id, r.group, r.label) for r in with_layouts([row], ["tool", "multi_turn"])]
        [('r1~tool', 'g1', 1), ('r1~multi_turn', 'g1', 1)]
    """
    for layout in layouts:
        if layout not in LAYOUTS:
            raise _unknown(layout)
    return [
        replace(pair, id=f"{pair.id}~{layout}", extra={**pair.extra, "layout": layout})
        for pair in pairs
        for layout in layouts
    ]


def with_drawn_layouts(pairs: Iterable[LabelledPair], more: int = 1) -> list[LabelledPair]:
    """Each row in ``pair`` and ``more`` (0 to 2) other layouts drawn from a hash of its group,
    so a clean row and its injected twins get the same ones (the calibration pool's layouts).

    Example:
        >>> row = LabelledPair("r1", "Summarize.", "Hi.", 0, group="g1")
        >>> [r.extra["layout"] for r in with_drawn_layouts([row], 2)]
        ['pair', 'multi_turn', 'user_message']
    """
    if not 0 <= more <= 2:
        raise ConfigError(f"more layouts must be 0, 1 or 2, got {more}")
    others = [name for name in LAYOUTS if name != "pair"]
    out: list[LabelledPair] = []
    for pair in pairs:
        digest = hashlib.sha256(pair.group.encode()).digest()
        first = digest[0] % len(others)
        second = (first + 1 + digest[1] % (len(others) - 1)) % len(others)
        out += with_layouts([pair], ["pair", others[first], others[second]][: 1 + more])
    return out
