"""Pure helpers: turn LangChain messages into guardrail ``Message``s with the untrusted spans
marked as data.

A guard knows the untrusted values of one call (e.g. the retrieved "context" string); wherever
such a value appears inside a trusted message, that substring becomes a ``Segment`` of kind
"data" and the rest of the message stays "instruction". Messages whose role is untrusted by
default (tool, assistant, ...) are data as a whole, as in ``guardrail.probe.prompts``.

Example:
    >>> [(s.kind, s.text) for s in mark_untrusted("Use: DOC. Answer.", ["DOC"])]
    [('instruction', 'Use: '), ('data', 'DOC'), ('instruction', '. Answer.')]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, ChatMessage

from guardrail.errors import RequestError
from guardrail.probe.prompts import TRUSTED_ROLES, Message, Segment, mark_untrusted

_ROLES = {
    "system": "system",
    "human": "user",
    "ai": "assistant",
    "tool": "tool",
    "function": "tool",
}


def untrusted_strings(value: Any) -> list[str]:
    """The strings a value can appear as inside a rendered prompt (non-blank ones only).

    A string is itself; a ``Document`` its page content; a message its text; a list or tuple
    each element plus its ``str()`` (what a prompt template renders for a list).

    Example:
        >>> untrusted_strings(["a doc", Document(page_content="b doc")])[:2]
        ['a doc', 'b doc']
    """
    found: list[str] = []
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, Document):
        found.append(value.page_content)
    elif isinstance(value, BaseMessage):
        found.append(value.text)
    elif isinstance(value, list | tuple):
        for item in value:
            found.extend(untrusted_strings(item))
        found.append(str(value))
    return [s for s in found if s.strip()]


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    return _ROLES.get(message.type, message.type)


def _text(message: BaseMessage, role: str) -> str:
    if isinstance(message.content, list) and role != "assistant":
        kinds = {b.get("type") for b in message.content if isinstance(b, dict)} - {"text"}
        if kinds:
            raise RequestError(
                f"a {role!r} message has non-text content ({', '.join(sorted(map(str, kinds)))}); "
                "the guarded model reads text only: send the text, or describe the attachment"
            )
    return message.text


def to_guardrail_messages(
    messages: Sequence[BaseMessage], untrusted: Sequence[str] = ()
) -> tuple[list[Message], set[str]]:
    """LangChain messages as guardrail messages, with ``untrusted`` values marked as data.

    System, user and developer messages are trusted except for the untrusted values inside
    them; any other role (tool, assistant, ...) is data as a whole. Returns the messages and
    the untrusted values found in them (so marked as data).

    Example:
        >>> from langchain_core.messages import HumanMessage, SystemMessage
        >>> msgs, found = to_guardrail_messages(
        ...     [SystemMessage("Answer from: DOC"), HumanMessage("Why?")], ["DOC"])
        >>> [s.kind for s in msgs[0].segments()], found
        (['instruction', 'data'], {'DOC'})
    """
    values = [v for v in dict.fromkeys(untrusted) if v.strip()]
    converted: list[Message] = []
    found: set[str] = set()
    for message in messages:
        role = _role(message)
        text = _text(message, role)
        found.update(v for v in values if v.strip() in text)
        if role in TRUSTED_ROLES:
            converted.append(Message(role=role, content=mark_untrusted(text, values)))
        else:
            converted.append(Message(role=role, content=[Segment(text=text, kind="data")]))
    return converted, found
