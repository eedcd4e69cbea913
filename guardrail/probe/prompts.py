"""Requests with trust marked, rendered through the model's chat template into token spans.

The probe needs to know which prompt tokens are the trusted instruction and which are untrusted
data, and the text it inspects must never steer that measurement. So:

- spans come from where the renderer *placed* each piece of content (the template is rendered
  with a unique placeholder per message, and the content is put where its placeholder landed),
  never from searching the rendered text for the content;
- content (trusted or not) is always tokenized as text: only the template's own markup yields
  control tokens such as ``<|im_start|>``, so data cannot forge a chat turn;
- a ``RequestError`` describes what is wrong by position, field, type and length, never by
  quoting the request's text.

Spans are computed on the final token ids from the tokenizer's character offsets, never from
hard-coded positions. See docs/security.md.

Accepted request forms:
- ``"plain text"``: one trusted user message (no data, so nothing to be distracted by);
- ``("instruction", "data")`` or ``GuardedPrompt(instruction=..., data=...)``: the instruction as
  the system message, the data in the user message after a neutral ``"Data: "`` prefix;
- a list of chat messages (dicts or ``Message``): system/user/developer are trusted, any other
  role (tool, document, ...) is data; ``trusted=`` overrides, and a message's content may be a
  list of ``Segment`` to mix trusted text with untrusted data inside one message;
- ``ChatWithTools(messages=..., tools=...)``: a chat with the application's tool definitions,
  which the template renders (as for ``vllm serve``). Tool definitions, an assistant message's
  ``tool_calls`` and a tool message's ``tool_call_id`` are template input, not content: they are
  part of the skeleton (span kind "other"), so they must hold no control-token string.

Example:
    >>> GuardedPrompt(instruction="Summarize the email.", data="Hi Bob, ...").data
    'Hi Bob, ...'
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import os
import re
import secrets
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from guardrail.errors import RequestError
from guardrail.probe.token_offsets import ByteTable, byte_table, char_offsets

SpanKind = Literal["instruction", "data", "other"]
TRUSTED_ROLES = frozenset({"system", "user", "developer"})
# Roles an error message may name; any other role is described by its length only.
_KNOWN_ROLES = TRUSTED_ROLES | {"assistant", "tool", "document", "function", "ipython", "data"}
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\[\]]{0,39}")
_T = TypeVar("_T")
_SURROGATE = (
    "a lone surrogate, which is not text (UTF-8 cannot encode it; often half of an emoji "
    "from a broken decode): decode the input with errors='replace', or remove that character"
)


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
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, OpenAI's form
    tool_call_id: str | None = None  # a tool message's: the call it answers

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


class ChatWithTools(BaseModel):
    """A chat and the tool definitions the template renders with it (OpenAI's ``tools``).

    Example:
        >>> tool = {"type": "function", "function": {"name": "get_weather"}}
        >>> len(ChatWithTools(messages=[{"role": "user", "content": "Hi"}], tools=[tool]).tools)
        1
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


RequestLike = (
    str | tuple[str, str] | GuardedPrompt | ChatWithTools | Sequence[Message | dict[str, Any]]
)


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


def _where(index: int, message: Message) -> str:
    """A message's position and role for an error message (an unusual role by its length only)."""
    if message.role in _KNOWN_ROLES:
        return f"message {index} (role {message.role!r})"
    return f"message {index} (a custom role of {len(message.role)} characters)"


def _value_type(value: Any) -> str:
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a value of type {type(value).__name__}"


def _validation_problem(exc: ValidationError) -> str:
    """Pydantic's errors by field, message and input type; never the input itself."""
    problems = []
    for error in exc.errors(include_url=False):
        fields = [
            str(p)
            if isinstance(p, int) or _FIELD_NAME.fullmatch(p)
            else f"<a field name of {len(p)} characters>"
            for p in error["loc"]
        ]
        message = str(error["msg"])
        value = error.get("input")
        if error["type"] == "string_unicode":
            message = f"contains {_SURROGATE}"
        elif isinstance(value, str) and value and value in message:
            message = f"failed the {error['type']!r} check"
        problems.append(f"{'.'.join(fields) or 'the value'}: {message} (got {_value_type(value)})")
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def _validated(where: str, build: Callable[..., _T], *args: Any) -> _T:
    """``build(*args)``, a pydantic error turned into a ``RequestError`` that quotes no input
    (raised outside the ``except`` block, so it carries no chained error that would)."""
    try:
        return build(*args)
    except ValidationError as exc:
        problem = _validation_problem(exc)
    raise RequestError(f"invalid {where}: {problem}")


def to_messages(request: RequestLike) -> list[Message]:
    """Normalise any accepted request form to messages; ``RequestError`` says what was wrong (by
    position, field, type and length: it never quotes the request's text)."""
    if isinstance(request, str):
        if not request.strip():
            raise RequestError("empty prompt: send some text")
        return [Message(role="user", content=request)]
    if isinstance(request, GuardedPrompt):
        return request.messages()
    if isinstance(request, ChatWithTools):
        return list(request.messages)
    if isinstance(request, tuple) and len(request) == 2:
        instruction, data = request
        if not isinstance(instruction, str) or not isinstance(data, str):
            raise RequestError(
                "an (instruction, data) request needs two strings, got "
                f"({type(instruction).__name__}, {type(data).__name__})"
            )
        return _validated("(instruction, data) request", _pair, instruction, data)
    if isinstance(request, Sequence) and request and not isinstance(request, bytes | bytearray):
        return [_validated(f"message {i}", _message, m) for i, m in enumerate(request)]
    raise RequestError(
        f"unsupported request of type {type(request).__name__}: send a string, an (instruction, "
        "data) tuple, a GuardedPrompt, or a non-empty list of chat messages"
    )


def _pair(instruction: str, data: str) -> list[Message]:
    return GuardedPrompt(instruction=instruction, data=data).messages()


def _message(value: Any) -> Message:
    return value if isinstance(value, Message) else Message.model_validate(value)


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


# --- the tokenizer's control tokens, and tokenizing text with none of them --------------------

_Encoding = tuple[list[int], list[tuple[int, int]]]  # token ids and their character offsets


@dataclass(frozen=True)
class _Vocab:
    """What the renderer needs to know about one tokenizer (cached per tokenizer object)."""

    size: int  # len(tokenizer) when this was built: a tokenizer that grew is looked at again
    control: dict[int, str]  # id -> text of every special (control) token
    unk_id: int | None
    encode_text: Callable[[str], _Encoding]  # tokenize as text: special tokens not recognised
    encode_batch: Callable[[list[str]], list[_Encoding]] | None  # the usual encoding, batched
    # the usual encoding's ids alone, and the table their offsets follow from (``_ids_encoder``)
    encode_ids: Callable[[list[str]], list[list[int]]] | None = None
    byte_table: ByteTable | None = None
    # roles of a request's messages, its markup (``_markup_key``) and the chat template given
    # (None: the tokenizer's own) -> (the template rendered with placeholders, the tag in them)
    skeletons: dict[tuple[tuple[str, ...], str, str | None], tuple[str, str]] = field(
        default_factory=dict
    )

    max_token_chars: int = 0  # no token spans more characters (0: unknown, no bound)

    @functools.cached_property
    def is_control(self) -> np.ndarray:
        """``is_control[id]``: whether ``id`` is a control token's, for ids up to the largest
        control id; the last entry (False) stands for every id above it."""
        table = np.zeros(max(self.control, default=0) + 2, dtype=np.bool_)
        table[list(self.control)] = True
        return table


_VOCABS: weakref.WeakKeyDictionary[Any, _Vocab] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def _private_backend(tokenizer: Any, encode_special_tokens: bool) -> Any:
    """A private copy of a fast tokenizer's backend (None without one): no truncation, no
    padding, and ``encode_special_tokens`` as given, whatever the caller's tokenizer is set to
    (its flags may be flipped by any call, in any thread)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    copy = type(backend).from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = encode_special_tokens
    return copy


def _text_encoder(tokenizer: Any) -> Callable[[str], _Encoding]:
    """Tokenize a string as text, with no special token recognised.

    A private copy of a fast tokenizer's backend with ``encode_special_tokens`` set (what
    ``split_special_tokens=True`` does, without flipping that flag on the caller's tokenizer,
    which other threads may be using); otherwise the tokenizer's own ``split_special_tokens``.
    """
    text_only = _private_backend(tokenizer, encode_special_tokens=True)
    if text_only is not None:

        def encode_backend(text: str) -> _Encoding:
            encoding = text_only.encode(text, add_special_tokens=False)
            return list(encoding.ids), [(int(a), int(b)) for a, b in encoding.offsets]

        return encode_backend

    def encode_split(text: str) -> _Encoding:
        encoded = tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True
        )
        return list(encoded["input_ids"]), [(int(a), int(b)) for a, b in encoded["offset_mapping"]]

    return encode_split


def _batch_encoder(whole: Any) -> Callable[[list[str]], list[_Encoding]]:
    """The usual encoding of many texts by ``whole``, a private copy of a fast tokenizer's
    backend (``_private_backend``): what ``tokenizer(texts, add_special_tokens=False)``
    computes, without its per-token Python conversion.

    A batch is encoded by a few threads of this module's own (``ENCODE_THREADS``; the backend
    releases the GIL while it encodes), never by the tokenizer's batch call, whose thread pool
    takes every core of the machine: next to a vLLM engine core that needs one to keep the GPU
    fed, that cost more than it saved (measured on the H200, docs/gpu.md)."""
    encode = functools.partial(whole.encode, add_special_tokens=False)

    def encode_batch(texts: list[str]) -> list[_Encoding]:
        encodings = _mapped(encode, texts)
        return [(e.ids, e.offsets) for e in encodings]

    return encode_batch


def _ids_encoder(whole: Any) -> tuple[Callable[[list[str]], list[list[int]]], ByteTable] | None:
    """The usual encoding's ids alone, by ``whole`` (as for ``_batch_encoder``), and the table
    their character offsets follow from; None unless ``whole`` has that shape
    (``token_offsets.byte_table``).

    ``encode_batch_fast`` skips the offsets, a fifth to a third of the encode. It is called with one
    text at a time, on this module's threads as above: with many texts it would spread them over
    the tokenizer's own thread pool, every core of the machine."""
    table = byte_table(whole) if hasattr(whole, "encode_batch_fast") else None
    if table is None:
        return None
    encode_one = functools.partial(whole.encode_batch_fast, add_special_tokens=False)

    def ids_of(text: str) -> list[int]:
        ids: list[int] = encode_one([text])[0].ids
        return ids

    def encode_ids(texts: list[str]) -> list[list[int]]:
        return _mapped(ids_of, texts)

    return encode_ids, table


def _mapped(encode: Callable[[str], _T], texts: list[str]) -> list[_T]:
    """``encode`` of each text: in the caller's thread, or on the encoding threads for a batch
    of ``MIN_THREADED_BATCH`` or more."""
    pool = _encode_pool() if len(texts) >= MIN_THREADED_BATCH else None
    return list(map(encode, texts) if pool is None else pool.map(encode, texts))


def _encode_threads() -> int:
    """How many threads encode a batch: a quarter of the cores, at most 4; 1 (the caller's own
    thread) when ``TOKENIZERS_PARALLELISM`` says false, as for the tokenizer's own pool."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").strip().lower() in ("0", "false", "off", "no"):
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))


ENCODE_THREADS = _encode_threads()
"""Threads that encode a batch of rendered requests (``_batch_encoder``), fixed at import."""
MIN_THREADED_BATCH = 8
"""A batch smaller than this is encoded in the caller's thread."""
_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _encode_pool() -> ThreadPoolExecutor | None:
    """The shared encoding threads (None when ``ENCODE_THREADS`` is 1), started on first use."""
    if ENCODE_THREADS <= 1:
        return None
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="guardrail-encode"))
        return _POOL[0]


def _vocab(tokenizer: Any) -> _Vocab:
    size = len(tokenizer)
    try:
        cached = _VOCABS.get(tokenizer)
    except TypeError:  # not weak-referenceable: no cache
        cached = None
    if cached is not None and cached.size == size:
        return cached
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    control = {int(i): str(t.content) for i, t in added.items() if getattr(t, "special", False)}
    names = getattr(tokenizer, "all_special_tokens", []) or []
    ids = getattr(tokenizer, "all_special_ids", []) or []
    for name, i in zip(names, ids, strict=False):
        control.setdefault(int(i), str(name))
    unk = getattr(tokenizer, "unk_token_id", None)
    # special tokens recognised: the template's markup must yield its control tokens
    whole = _private_backend(tokenizer, encode_special_tokens=False)
    fast = None if whole is None else _ids_encoder(whole)
    vocab = _Vocab(
        size,
        control,
        unk,
        _text_encoder(tokenizer),
        None if whole is None else _batch_encoder(whole),
        encode_ids=None if fast is None else fast[0],
        byte_table=None if fast is None else fast[1],
        max_token_chars=_max_token_chars(tokenizer),
    )
    try:
        with _VOCABS_LOCK:
            _VOCABS[tokenizer] = vocab
    except TypeError:
        pass
    return vocab


def _max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token can cover: the longest entry of the
    vocabulary as stored (byte-level vocabularies store one character per byte, byte-fallback
    entries are longer than the byte they stand for: both only overestimate). 0 when the
    tokenizer has no vocabulary to read."""
    try:
        return max((len(token) for token in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without get_vocab: no bound
        return 0


def control_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of ``tokenizer``'s special (control) tokens: ids content never yields.

    Example:
        >>> control_token_ids(tokenizer)  # doctest: +SKIP
        frozenset({0, 1, 2})
    """
    return frozenset(_vocab(tokenizer).control)


# --- rendering ---------------------------------------------------------------------------------


def _strings(value: Any) -> Iterable[str]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _check_markup(
    messages: list[Message], tools: list[dict[str, Any]] | None, control: list[str]
) -> None:
    """Refuse template input that is not content (tool definitions, tool calls, tool call ids)
    holding a control-token string or text the tokenizer cannot take: it is rendered as the
    template's own markup, so it would yield control tokens (a forged turn)."""
    pieces = [("the tool definitions", tools)] + [
        (_where(i, m), [m.tool_calls, m.tool_call_id]) for i, m in enumerate(messages)
    ]
    for where, value in pieces:
        for text in _strings(value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"{where}: a tool field holds {_SURROGATE}") from None
            if any(c in text for c in control):
                raise RequestError(
                    f"{where}: a tool definition, tool call or tool call id contains a control "
                    "token of this model's tokenizer; these are rendered as chat-template markup, "
                    "so they must hold no chat-template control strings"
                )


def _check_text(
    messages: list[Message], control: Iterable[str], tools: list[dict[str, Any]] | None = None
) -> None:
    """Refuse text the tokenizer cannot take, and roles or tool fields that would forge template
    markup."""
    control = [c for c in control if c]
    _check_markup(messages, tools, control)
    for i, message in enumerate(messages):
        pieces = [("its role", message.role)]
        pieces += [(f"segment {j} ({s.kind})", s.text) for j, s in enumerate(message.segments())]
        for what, text in pieces:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                position = exc.start
            else:
                continue
            raise RequestError(
                f"{_where(i, message)}, {what}: character {position} is {_SURROGATE}"
            )
        if any(c in message.role for c in control):
            raise RequestError(
                f"message {i}: its role contains a control token of this model's tokenizer; a "
                "role is chat-template markup, so it must be a plain name such as 'user' or 'tool'"
            )


def _tool_call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as vLLM hands it to a chat template: the function's ``arguments``
    (a JSON string) decoded to an object, ``{}`` when it is not one
    (``vllm.renderers.chat_utils``)."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def _chat_message(message: Message, content: str) -> dict[str, Any]:
    chat: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls is not None:
        chat["tool_calls"] = [_tool_call_for_template(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        chat["tool_call_id"] = message.tool_call_id
    return chat


def _template(
    tokenizer: Any,
    messages: list[Message],
    contents: list[str],
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> str:
    """The chat rendered by ``chat_template``, or by the tokenizer's own template when None.
    The template is passed to ``apply_chat_template``, never set on the tokenizer: vLLM's
    engine tokenizer renders on private copies of itself, which an attribute set later misses."""
    chat = [_chat_message(m, c) for m, c in zip(messages, contents, strict=True)]
    return str(
        tokenizer.apply_chat_template(
            chat,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
        )
    )


def _markup_key(messages: list[Message], tools: list[dict[str, Any]] | None) -> str:
    """The template input besides roles and content, as canonical JSON ("" when there is none):
    with the roles, what a skeleton depends on (different tools, a different skeleton). A
    tool-call message's empty content is part of it: it gets no placeholder (``_holders``)."""
    calls = [
        (i, m.tool_calls, m.tool_call_id, _no_holder(m))
        for i, m in enumerate(messages)
        if m.tool_calls is not None or m.tool_call_id is not None
    ]
    if not tools and not calls:
        return ""
    # repr for what JSON cannot hold: the template then refuses it, as one bad request
    return json.dumps([tools, calls], sort_keys=True, ensure_ascii=False, default=repr)


def _tag_is_free(messages: list[Message], tag: str, markup: str = "") -> bool:
    """Whether ``tag`` appears in no role, no content and no markup of ``messages``."""
    texts = [m.role for m in messages] + [s.text for m in messages for s in m.segments()]
    return not any(tag in text for text in [*texts, markup])


def _fresh_tag(messages: list[Message], markup: str = "") -> str:
    """Random hex that appears in no role, no content and no markup of ``messages``."""
    while True:
        tag = secrets.token_hex(8)
        if _tag_is_free(messages, tag, markup):
            return tag


def _no_holder(message: Message) -> bool:
    """An assistant's tool-call turn with no content: rendered with its content empty, not a
    placeholder (templates render such a turn's content only when there is some)."""
    return message.tool_calls is not None and not any(s.text for s in message.segments())


def _holders(messages: list[Message], tag: str) -> list[str]:
    """``_placeholders``, with "" for a message that gets none (``_no_holder``)."""
    holders = _placeholders(tag, len(messages))
    return ["" if _no_holder(m) else h for m, h in zip(messages, holders, strict=True)]


def _placeholders(tag: str, count: int) -> list[str]:
    """One unique string per message: ``tag`` between private-use characters, which no template
    contains (``tag`` must be absent from every role and content: ``_tag_is_free``)."""
    return [f"\ue000{tag}.{i}\ue001" for i in range(count)]


def _render_skeleton(
    messages: list[Message],
    tokenizer: Any,
    holders: list[str],
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> str:
    """The template rendered with placeholders: its errors can quote no content."""
    try:
        return _template(tokenizer, messages, holders, tools, chat_template)
    except Exception as exc:  # a template raises whatever it likes (jinja2 TemplateError, ...)
        failure = type(exc).__name__
        detail = str(exc)
        for i, holder in enumerate(holders):
            if holder:
                detail = detail.replace(holder, f"<content of message {i}>")
        known = all(m.role in _KNOWN_ROLES for m in messages)
        detail = f": {detail[:300]}" if known and detail else ""
    roles = [m.role if m.role in _KNOWN_ROLES else "<custom>" for m in messages]
    raise RequestError(
        f"the model's chat template refused these messages ({failure}{detail}); roles in order: "
        f"{roles}. Check the roles and their order (many templates need alternating user and "
        "assistant turns, or allow only one system message, first)"
    )


def _render(
    messages: list[Message],
    tokenizer: Any,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> tuple[str, list[tuple[int, int, SpanKind]]]:
    """Render the chat template; return the text and each segment's character range.

    The template is rendered once with a unique placeholder in place of each message's content;
    each content is then put where its placeholder landed, and its segments' ranges recorded as
    they are placed (never found by searching the text). The result must equal the template
    rendered with the real contents, or the request is refused. ``tools`` (and messages' tool
    calls) are rendered by the template as its own markup, in the skeleton. ``chat_template``
    renders instead of the tokenizer's own template when given.
    """
    contents = ["".join(s.text for s in m.segments()) for m in messages]
    skeletons = _vocab(tokenizer).skeletons
    markup = _markup_key(messages, tools)
    key = (tuple(m.role for m in messages), markup, chat_template)
    if key in skeletons:  # the skeleton depends on roles, markup and template alone: made once
        skeleton, tag = skeletons[key]
        if _tag_is_free(messages, tag, markup):
            holders = _holders(messages, tag)
            try:
                return _place(
                    messages, tokenizer, contents, skeleton, holders, tools, chat_template
                )
            except RequestError:  # e.g. a template that renders today's date: render afresh
                pass
    tag = _fresh_tag(messages, markup)
    holders = _holders(messages, tag)
    skeleton = _render_skeleton(messages, tokenizer, holders, tools, chat_template)
    rendered = _place(messages, tokenizer, contents, skeleton, holders, tools, chat_template)
    if len(skeletons) < MAX_SKELETONS:
        skeletons[key] = (skeleton, tag)
    return rendered


MAX_SKELETONS = 256
"""Skeletons kept per tokenizer (one per sequence of roles and markup seen)."""


def _place(
    messages: list[Message],
    tokenizer: Any,
    contents: list[str],
    skeleton: str,
    holders: list[str],
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> tuple[str, list[tuple[int, int, SpanKind]]]:
    """Put each content where its placeholder landed in ``skeleton``, recording its segments'
    character ranges; checked against the template rendered with the real contents."""
    placed: list[tuple[int, int]] = []
    for i, (message, holder) in enumerate(zip(messages, holders, strict=True)):
        if not holder:  # no content to place (``_no_holder``)
            continue
        count = skeleton.count(holder)
        if count == 0:
            raise RequestError(
                f"the chat template drops or rewrites the content of {_where(i, message)}, so "
                "its tokens cannot be located: if this model's template leaves out that role or "
                "position, merge the message into a neighbouring one or change its role; if it "
                "rewrites content, use a template that inserts content unchanged"
            )
        if count > 1:
            raise RequestError(
                f"the chat template repeats the content of {_where(i, message)} ({count} "
                "times), so its tokens cannot be located: send that content in a message this "
                "template renders once"
            )
        placed.append((skeleton.index(holder), i))
    parts: list[str] = []
    ranges: list[tuple[int, int, SpanKind]] = []
    cursor = length = 0
    for at, i in sorted(placed):
        parts.append(skeleton[cursor:at])
        length += at - cursor
        for segment in messages[i].segments():
            ranges.append((length, length + len(segment.text), segment.kind))
            length += len(segment.text)
        parts.append(contents[i])
        cursor = at + len(holders[i])
    parts.append(skeleton[cursor:])
    text = "".join(parts)
    _check_same_as_template(messages, tokenizer, contents, text, tools, chat_template)
    return text, ranges


def _check_same_as_template(
    messages: list[Message],
    tokenizer: Any,
    contents: list[str],
    text: str,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> None:
    """Refuse a rendering (content put in place of placeholders) that is not what the template
    renders with the real content: the template transforms content or depends on it."""
    try:
        real = _template(tokenizer, messages, contents, tools, chat_template)
    except Exception as exc:  # the template's message could quote the content: not kept
        real = None
        failure = type(exc).__name__
    if real is None:
        raise RequestError(
            f"the chat template failed on the messages' content ({failure}) but not on "
            "placeholders: it inspects or transforms content, so content tokens cannot be "
            "located; use a template that inserts message content unchanged"
        )
    if real != text:
        padded = [i for i, c in enumerate(contents) if c != c.strip()]
        if padded:
            where = _where(padded[0], messages[padded[0]])
            raise RequestError(
                f"the chat template changed the content of {where} "
                "(e.g. stripped whitespace), so its tokens cannot be located; strip leading and "
                "trailing whitespace from the content first"
            )
        raise RequestError(
            "the chat template does not insert message content unchanged (it rewrites it, or "
            "renders differently depending on it), so content tokens cannot be located; use a "
            "template that inserts message content as it is"
        )


# --- tokenizing --------------------------------------------------------------------------------


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged, non-empty character ranges."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _overlaps(ranges: list[tuple[int, int]], starts: list[int], lo: int, hi: int) -> bool:
    """Whether [lo, hi) meets one of the sorted disjoint ``ranges`` (``starts``: their starts)."""
    k = bisect.bisect_left(starts, hi) - 1
    return hi > lo and k >= 0 and ranges[k][1] > lo


def _encode_failure(failure: str) -> RequestError:
    return RequestError(
        f"the tokenizer could not encode the rendered request ({failure}); if every request "
        "fails this way, the tokenizer is the problem (a fast tokenizer with offsets is needed)"
    )


def _encode_whole(tokenizer: Any, texts: list[str]) -> list[_Encoding | RequestError]:
    """Each text's usual encoding with the tokenizer's offsets (a fast tokenizer's private
    backend, on the encoding threads for a batch); one text that fails fails alone."""
    encode_batch = _vocab(tokenizer).encode_batch
    if encode_batch is None:

        def encode_batch(texts: list[str]) -> list[_Encoding]:
            encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            pairs = zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
            return [(list(ids), [(int(a), int(b)) for a, b in offsets]) for ids, offsets in pairs]

    return _each(encode_batch, texts)


def _each(
    encode_batch: Callable[[list[str]], list[_T]], texts: list[str]
) -> list[_T | RequestError]:
    """``encode_batch(texts)``; if it fails, each text is tried alone so one bad text fails
    alone, as a ``RequestError``."""
    try:
        return list(encode_batch(texts))
    except Exception as exc:  # the tokenizer's message could quote the text: not kept
        if len(texts) == 1:
            return [_encode_failure(type(exc).__name__)]
    return [_each(encode_batch, [text])[0] for text in texts]


_Whole = tuple[list[int], np.ndarray]  # token ids, and their character offsets [tokens, 2]


def _encode_bounded(tokenizer: Any, texts: list[str]) -> list[_Whole | RequestError]:
    """Each text's usual encoding (``_encode_whole``'s ids and offsets), cheaper where the
    offsets follow from the ids (``token_offsets``): the ids alone are encoded and their
    offsets computed; a text whose ids do not spell it is encoded again with offsets."""
    vocab = _vocab(tokenizer)
    if vocab.encode_ids is None or vocab.byte_table is None:
        return [_with_bounds(whole) for whole in _encode_whole(tokenizer, texts)]
    encoded = _each(vocab.encode_ids, texts)
    results: list[_Whole | RequestError] = []
    for text, ids in zip(texts, encoded, strict=True):
        bounds = (
            None if isinstance(ids, RequestError) else char_offsets(vocab.byte_table, text, ids)
        )
        if bounds is None or isinstance(ids, RequestError):
            # the tokenizer changed or dropped some of the text: its own offsets
            results.append(_with_bounds(_encode_whole(tokenizer, [text])[0]))
        else:
            results.append((ids, bounds))
    return results


def _with_bounds(whole: _Encoding | RequestError) -> _Whole | RequestError:
    return whole if isinstance(whole, RequestError) else (whole[0], _bounds(whole[1]))


def _bounds(offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """Offsets as an array [tokens, 2]."""
    flat = itertools.chain.from_iterable(offsets)  # twice as fast as np.asarray on tuples
    return np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)


def _is_control(vocab: _Vocab, text: str, token: int, lo: int, hi: int) -> bool:
    """Whether ``token`` (covering ``text[lo:hi]``) is a control token; an unknown-character
    token is not one unless it spells the unknown token's string."""
    name = vocab.control.get(token)
    return name is not None and (token != vocab.unk_id or name in text[lo:hi])


def _forged(vocab: _Vocab, text: str, content: list[tuple[int, int]], encoding: _Encoding) -> bool:
    """Whether a control token of ``encoding`` lies (even partly) in ``content``."""
    return _forged_at(vocab, text, content, *encoding)


def _forged_at(
    vocab: _Vocab,
    text: str,
    content: list[tuple[int, int]],
    ids: list[int],
    offsets: Sequence[tuple[int, int]] | np.ndarray,
) -> bool:
    """``_forged`` of ids and their offsets (a sequence of pairs, or an array [tokens, 2])."""
    starts = [lo for lo, _ in content]
    for i in _control_positions(vocab, ids):
        lo, hi = int(offsets[i][0]), int(offsets[i][1])
        if _is_control(vocab, text, ids[i], lo, hi) and _overlaps(content, starts, lo, hi):
            return True
    return False


def _control_positions(vocab: _Vocab, ids: list[int]) -> list[int]:
    """Positions of control-token ids in ``ids`` (one vectorised pass, not a loop per token)."""
    if not vocab.control:
        return []
    array = np.fromiter(ids, dtype=np.int64, count=len(ids))
    return np.flatnonzero(vocab.is_control.take(array, mode="clip")).tolist()


def _encode_content_as_text(
    tokenizer: Any, text: str, content: list[tuple[int, int]], whole: _Encoding
) -> _Encoding:
    """``text`` split at the template's own control tokens (those of ``whole``, its usual
    encoding, that lie outside ``content``), each piece between them tokenized as text.

    This is what a fast tokenizer does inside anyway (split on special tokens, then tokenize each
    piece on its own), except that content's special strings are not recognised: on byte-level
    BPE tokenizers (the tests' and SmolLM2's) it gives the usual ids for ordinary text.
    """
    vocab = _vocab(tokenizer)
    starts = [lo for lo, _ in content]
    markup = [
        (token, lo, hi)
        for token, (lo, hi) in zip(*whole, strict=True)
        if token in vocab.control
        and _is_control(vocab, text, token, lo, hi)
        and not _overlaps(content, starts, lo, hi)
    ]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    cursor = 0
    for token, lo, hi in [*markup, (-1, len(text), len(text))]:
        if lo > cursor:
            piece_ids, piece_offsets = vocab.encode_text(text[cursor:lo])
            ids += piece_ids
            offsets += [(a + cursor, b + cursor) for a, b in piece_offsets]
        if token != -1:
            ids.append(token)
            offsets.append((lo, hi))
            cursor = hi
    return ids, offsets


def _tokenize(
    tokenizer: Any, text: str, content: list[tuple[int, int]], whole: _Encoding
) -> _Encoding:
    """Token ids and offsets of ``text`` where only the template's markup (outside ``content``)
    yields control tokens.

    ``whole`` is the text's usual encoding (the shipped configs were calibrated on exactly
    these ids), kept unless a control token lies in content (content that spells
    ``<|im_end|>``, say): then the content is tokenized again as text
    (``_encode_content_as_text``).
    """
    vocab = _vocab(tokenizer)
    if not _forged(vocab, text, content, whole):
        return whole
    encoding = _encode_content_as_text(tokenizer, text, content, whole)
    if _forged(vocab, text, content, encoding):
        raise RequestError(
            "the content holds a control token of this model's tokenizer that the tokenizer "
            "cannot encode as plain text; remove chat-template control strings from the content "
            "(the FORGED_TURNS policy refuses such data)"
        )
    return encoding


def _runs(flags: np.ndarray | Sequence[bool]) -> list[tuple[int, int]]:
    """Half-open runs of True in a sequence of booleans."""
    as_int = np.asarray(flags, dtype=np.int8).reshape(-1)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], as_int, [0]))))
    return [(int(lo), int(hi)) for lo, hi in zip(edges[::2], edges[1::2], strict=True)]


_KIND_CODES: dict[SpanKind, int] = {"other": 0, "instruction": 1, "data": 2}


def _token_kinds(
    offsets: Sequence[tuple[int, int]], ranges: list[tuple[int, int, SpanKind]]
) -> np.ndarray:
    """Each token's kind code (``_KIND_CODES``): that of the segment holding its last character
    ("other" if none)."""
    return _kinds(_bounds(offsets), ranges)


def _kinds(bounds: np.ndarray, ranges: list[tuple[int, int, SpanKind]]) -> np.ndarray:
    """``_token_kinds`` of offsets as an array [tokens, 2]."""
    placed = sorted((lo, hi, kind) for lo, hi, kind in ranges if hi > lo)
    if not placed or not len(bounds):
        return np.zeros(len(bounds), dtype=np.int8)
    starts = np.array([lo for lo, _, _ in placed], dtype=np.int64)
    stops = np.array([hi for _, hi, _ in placed], dtype=np.int64)
    codes = np.array([_KIND_CODES[kind] for _, _, kind in placed], dtype=np.int8)
    last_char = bounds[:, 1] - 1
    k = np.searchsorted(starts, last_char, side="right") - 1
    at = k.clip(min=0)
    inside = (bounds[:, 1] > bounds[:, 0]) & (k >= 0) & (stops[at] > last_char)
    return np.where(inside, codes[at], 0).astype(np.int8)


@dataclass(frozen=True)
class _Rendered:
    messages: list[Message]
    text: str
    ranges: list[tuple[int, int, SpanKind]]


def _rendered(request: RequestLike, tokenizer: Any, chat_template: str | None = None) -> _Rendered:
    messages = to_messages(request)
    tools = request.tools if isinstance(request, ChatWithTools) else None
    _check_text(messages, _vocab(tokenizer).control.values(), tools)
    if not any(s.text.strip() for m in messages for s in m.segments() if s.kind == "instruction"):
        raise RequestError(
            "the request has no trusted instruction text: add a system or user "
            "message, or an instruction"
        )
    text, ranges = _render(messages, tokenizer, tools, chat_template)
    return _Rendered(messages, text, ranges)


def _prepared(
    rendered: _Rendered, whole: _Whole, tokenizer: Any, max_tokens: int | None
) -> PreparedPrompt:
    text, ranges = rendered.text, rendered.ranges
    content = _merged((lo, hi) for lo, hi, _ in ranges)
    token_ids, bounds = whole
    if _forged_at(_vocab(tokenizer), text, content, token_ids, bounds):  # content is re-encoded
        offsets = [(lo, hi) for lo, hi in bounds.tolist()]
        token_ids, offsets = _tokenize(tokenizer, text, content, (token_ids, offsets))
        bounds = _bounds(offsets)
    if not token_ids:
        raise RequestError("the request rendered to zero tokens")
    if max_tokens is not None and len(token_ids) >= max_tokens:
        raise RequestError(
            f"the request has {len(token_ids)} prompt tokens but the engine's context is "
            f"{max_tokens} tokens (max_model_len), leaving no room to generate: shorten the "
            "data or start the engine with a larger max_model_len"
        )
    kinds = _kinds(bounds, ranges)
    return PreparedPrompt(
        token_ids=list(token_ids),
        instruction_spans=_runs(kinds == _KIND_CODES["instruction"]),
        data_spans=_runs(kinds == _KIND_CODES["data"]),
        text=text,
        segments=tuple(s for m in rendered.messages for s in m.segments()),
    )


def prepare_prompts(
    requests: Sequence[RequestLike],
    tokenizer: Any,
    max_tokens: int | None = None,
    chat_template: str | None = None,
) -> list[PreparedPrompt | RequestError]:
    """``prepare_prompt`` for a batch: each request rendered, then all tokenized in one call.

    Returns one entry per request, in order: its ``PreparedPrompt``, or the ``RequestError``
    that refused it (one bad request fails alone).
    ``chat_template`` (a Jinja template) renders instead of the tokenizer's own when given.

    Example:
        >>> prepare_prompts([("Summarize.", "Hi"), "Hello"], tokenizer)  # doctest: +SKIP
        [PreparedPrompt(...), PreparedPrompt(...)]
    """
    results: dict[int, PreparedPrompt | RequestError] = {}
    rendered: dict[int, _Rendered] = {}
    # no token covers more than ``longest`` characters: a text twice as long as the context
    # could hold even so is refused cheaply (nearer the limit the tokenizer counts exactly)
    longest = _vocab(tokenizer).max_token_chars
    bound = None if max_tokens is None or not longest else 2 * max_tokens * longest
    for i, request in enumerate(requests):
        try:
            item = _rendered(request, tokenizer, chat_template)
            if bound is not None and len(item.text) > bound:
                raise RequestError(  # cheaply, before the tokenizer spends seconds on it
                    f"the request renders to more characters than {max_tokens} tokens "
                    f"(max_model_len) can hold, at most {longest} characters per token: "
                    "shorten the data"
                )
            rendered[i] = item
        except RequestError as exc:
            results[i] = exc
    wholes = _encode_bounded(tokenizer, [r.text for r in rendered.values()]) if rendered else []
    for (i, item), whole in zip(rendered.items(), wholes, strict=True):
        try:
            if isinstance(whole, RequestError):
                raise whole
            results[i] = _prepared(item, whole, tokenizer, max_tokens)
        except RequestError as exc:
            results[i] = exc
    return [results[i] for i in range(len(requests))]


def prepare_prompt(
    request: RequestLike,
    tokenizer: Any,
    max_tokens: int | None = None,
    chat_template: str | None = None,
) -> PreparedPrompt:
    """Render ``request`` with the model's chat template (``chat_template`` when given) and
    compute its token spans.

    A token belongs to the segment that holds its last character (byte-level BPE glues a
    leading space to the next word, so a token straddling a boundary belongs to the word).
    Content never yields a control token; a request that cannot be rendered safely raises
    ``RequestError`` (whose message never quotes the request's text).

    Example:
        >>> p = prepare_prompt(("Translate to French.", "Hello"), tokenizer)  # doctest: +SKIP
        >>> p.data_spans  # doctest: +SKIP
        [(17, 18)]
    """
    [prepared] = prepare_prompts([request], tokenizer, max_tokens, chat_template)
    if isinstance(prepared, RequestError):
        raise prepared
    return prepared


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
