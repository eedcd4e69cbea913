"""Property-based fuzzing of ``prepare_prompt`` on real tokenizers (hypothesis).

Requests are generated from arbitrary unicode plus the strings most likely to confuse a renderer:
very short pieces ("t"), role names, template fragments, every special token of the tokenizers,
placeholder-like private-use characters, whitespace-only pieces and lone surrogates. The tiny
models' templates and SmolLM2's are ChatML, so the test renders each request itself (an oracle
that knows where every piece of content goes) and checks, for every example:

(a) the result is a ``PreparedPrompt``, or a ``RequestError`` exactly when the request is
    malformed (a lone surrogate, no trusted instruction text); never another exception;
(b) spans cover exactly the content's tokens. With each token's character range taken from the
    tokenizer's offsets: a token is in an instruction (data) span iff its last character lies in
    an instruction (data) segment; and, where the tokenizer gives the text back verbatim (its
    offsets are off around a character it drops or normalizes), every non-whitespace content
    character lies in a token whose last character is in the same message's content (never in
    template markup), a content token reaches into template markup only over whitespace, and
    the tokens of a one-segment message decode to its text up to surrounding whitespace;
(c) content never yields a control token: the control tokens are exactly the template's markup
    (same strings, same character positions), and the ids decode back to the rendered text;
(d) when no content spells a control token, the token ids equal whole-text tokenization.

Profiles: ``ci`` (default: derandomized, so CI is reproducible) and ``explore`` (random seeds,
more examples; a failure prints the blob to reproduce it). Pick one with
``GUARDRAIL_FUZZ_PROFILE=explore``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from guardrail.errors import RequestError
from guardrail.probe import prompts
from guardrail.probe.prompts import PreparedPrompt, control_token_ids, prepare_prompt

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("explore", max_examples=1000, deadline=None, print_blob=True)
FUZZ = settings.get_profile(os.environ.get("GUARDRAIL_FUZZ_PROFILE", "ci"))

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Every added token of the three tokenizers (the tiny models' are the first three).
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]
TRICKY = [
    "",
    "t",
    "s",
    "m",
    "user",
    "system",
    "assistant",
    "tool",
    "\n",
    " ",
    "  ",
    "\t",
    "Data: ",
    "<|",
    "|>",
    "im_start",
    "_end",
    "Hugging Face",
    SMOLLM2_SYSTEM,
    "<|im_start|>system\n",
    "<|im_end|>\n<|im_start|>user\n",
    "\ue000",
    "\ue001",
    "\ue0000123456789abcdef.0\ue001",
    "😀",
    "é",
    "\u200b",
    "\x00",
    "\r\n",
    "\u2028",
    "[INST]",
    "<s>",
]

_piece = st.one_of(
    st.text(max_size=24),
    st.sampled_from(TRICKY + SPECIALS),
    st.text(alphabet=" \t\n\r\x0b\x0c\u00a0\u3000", max_size=4),
)
_clean_text = st.lists(_piece, min_size=1, max_size=4).map("".join)
_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_bad_text = st.tuples(_clean_text, _surrogate, _clean_text).map("".join)
# One text in 40 holds a lone surrogate (malformed: must be refused with a RequestError).
TEXT = st.integers(0, 39).flatmap(lambda k: _bad_text if k == 0 else _clean_text)
ROLES = st.sampled_from(["system", "user", "developer", "assistant", "tool", "document"])
KINDS = st.sampled_from(["instruction", "data", "other"])
SEGMENTS = st.lists(st.fixed_dictionaries({"text": TEXT, "kind": KINDS}), max_size=4)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES, "content": st.one_of(TEXT, SEGMENTS)}, optional={"trusted": st.booleans()}
)
TRUSTED = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user"]), "content": _clean_text.map(lambda t: t + " x")}
)
PAIR_OR_PLAIN = st.one_of(
    st.tuples(TEXT.map(lambda t: t + " x"), TEXT), st.tuples(TEXT, TEXT), TEXT
)
CHAT = st.one_of(
    st.lists(MESSAGE, min_size=1, max_size=5),
    st.tuples(st.lists(MESSAGE, max_size=4), st.integers(0, 4), TRUSTED).map(
        lambda t: [*t[0][: t[1]], t[2], *t[0][t[1] :]]
    ),
)


@lru_cache(maxsize=4)
def _load(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class Model:
    tokenizer: Any
    default_system: str | None  # the system prompt the template adds when none is first


@pytest.fixture(
    scope="module",
    params=[
        "tiny_llama_dir",
        "tiny_qwen2_dir",
        pytest.param("smollm2_dir", marks=pytest.mark.slow),
    ],
)
def model(request) -> Model:
    tokenizer = _load(str(request.getfixturevalue(request.param)))
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    assert added | set(tokenizer.all_special_tokens) <= set(SPECIALS)  # the fuzz covers them all
    default = SMOLLM2_SYSTEM if request.param == "smollm2_dir" else None
    return Model(tokenizer, default)


# --- the oracle: the request as ChatML, rendered by hand --------------------------------------


@dataclass(frozen=True)
class Rendered:
    text: str
    ranges: list[tuple[int, int, str, int]]  # each segment: start, end, kind, message index
    markup: list[tuple[int, int, str]]  # each control string the template wrote: start, end, text
    contents: list[str]  # each message's content
    roles: list[str]


def _messages(request: Any) -> list[tuple[str, list[tuple[str, str]]]]:
    """The request as (role, [(text, kind)]) messages, by the documented rules."""
    if isinstance(request, str):
        return [("user", [(request, "instruction")])]
    if isinstance(request, tuple):
        return [
            ("system", [(request[0], "instruction")]),
            ("user", [("Data: ", "other"), (request[1], "data")]),
        ]
    out = []
    for m in request:
        if isinstance(m["content"], str):
            trusted = m.get("trusted", m["role"] in ("system", "user", "developer"))
            out.append((m["role"], [(m["content"], "instruction" if trusted else "data")]))
        else:
            out.append((m["role"], [(s["text"], s["kind"]) for s in m["content"]]))
    return out


def _render(request: Any, default_system: str | None) -> Rendered:
    messages = _messages(request)
    parts: list[str] = []
    ranges: list[tuple[int, int, str, int]] = []
    markup: list[tuple[int, int, str]] = []
    length = 0

    def write(text: str, control: bool = False) -> None:
        nonlocal length
        if control:
            markup.append((length, length + len(text), text))
        parts.append(text)
        length += len(text)

    def turn(role: str, body: list[tuple[str, str]], index: int) -> None:
        write("<|im_start|>", True)
        write(role + "\n")
        for text, kind in body:
            if index >= 0:
                ranges.append((length, length + len(text), kind, index))
            write(text)
        write("<|im_end|>", True)
        write("\n")

    if default_system is not None and messages[0][0] != "system":
        turn("system", [(default_system, "other")], -1)
    for i, (role, body) in enumerate(messages):
        turn(role, body, i)
    write("<|im_start|>", True)
    write("assistant\n")
    contents = ["".join(t for t, _ in body) for _, body in messages]
    return Rendered("".join(parts), ranges, markup, contents, [r for r, _ in messages])


def _malformed(request: Any) -> set[str]:
    """Why prepare_prompt must refuse the request: words one of which its error must contain."""
    messages = _messages(request)
    texts = [t for _, body in messages for t, _ in body] + [r for r, _ in messages]
    why = set()
    if any(0xD800 <= ord(c) <= 0xDFFF for t in texts for c in t):
        why.add("lone surrogate")
    if not any(t.strip() for _, body in messages for t, k in body if k == "instruction"):
        why.add("empty prompt" if isinstance(request, str) else "instruction")
    return why


# --- the properties ----------------------------------------------------------------------------


def _check(model: Model, request: Any) -> None:
    tokenizer = model.tokenizer
    try:
        p = prepare_prompt(request, tokenizer)
    except RequestError as error:
        why = _malformed(request)
        assert why, f"refused a well-formed request: {error}"  # (a)
        assert any(reason in str(error) for reason in why), str(error)
        event("refused (malformed)")
        return
    assert isinstance(p, PreparedPrompt) and not _malformed(request)  # (a)
    oracle = _render(request, model.default_system)
    assert p.text == oracle.text
    content = prompts._merged((lo, hi) for lo, hi, _, _ in oracle.ranges)
    ids, offsets = prompts._tokenize(
        tokenizer, p.text, content, prompts._encode_whole(tokenizer, [p.text])[0]
    )  # offsets of p's own tokens
    assert ids == p.token_ids
    _check_control(model, p, offsets, oracle)
    _check_spans(tokenizer, p, offsets, oracle)
    control = [t.content for t in tokenizer.added_tokens_decoder.values()]
    if not any(c in text for c in control for text in oracle.contents):  # (d)
        whole = tokenizer(p.text, add_special_tokens=False)["input_ids"]
        assert p.token_ids == whole
        event("prepared, ordinary content")
    else:
        event("prepared, content spells a control token")


def _check_control(
    model: Model, p: PreparedPrompt, offsets: list[tuple[int, int]], oracle: Rendered
) -> None:
    """(c): control tokens are exactly the template's markup; the ids spell the text."""
    tokenizer = model.tokenizer
    control = control_token_ids(tokenizer)
    found = [
        (*offsets[i], tokenizer.convert_ids_to_tokens(t))
        for i, t in enumerate(p.token_ids)
        if t in control
    ]
    assert found == oracle.markup
    if _lossless(tokenizer, p.text):
        assert tokenizer.decode(p.token_ids, clean_up_tokenization_spaces=False) == p.text
    else:
        event("text the tokenizer does not give back verbatim")


def _lossless(tokenizer: Any, text: str) -> bool:
    """Whether the tokenizer gives back ``text`` verbatim. Not always: SmolLM2's has no token for
    a few bytes (the lead byte of U+40000 and above, some C0 controls) and drops them, and the
    tiny Qwen2 one normalizes to NFC; offsets are off around such characters."""
    ids = prompts._vocab(tokenizer).encode_text(text)[0]
    return bool(tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text)


def _check_spans(
    tokenizer: Any, p: PreparedPrompt, offsets: list[tuple[int, int]], oracle: Rendered
) -> None:
    """(b): spans hold exactly the tokens whose last character is content of their kind."""
    text = p.text
    owner: dict[int, tuple[str, int]] = {}  # content character -> (kind, message index)
    for lo, hi, kind, message in oracle.ranges:
        owner.update((c, (kind, message)) for c in range(lo, hi))
    spans = {"instruction": p.instruction_spans, "data": p.data_spans}
    for kind, runs in spans.items():
        held = {i for a, b in runs for i in range(a, b)}
        expected = {
            i
            for i, (lo, hi) in enumerate(offsets)
            if hi > lo and owner.get(hi - 1, ("",))[0] == kind
        }
        assert held == expected, kind
    if not _lossless(tokenizer, text):
        return  # offsets around a dropped or normalized character are off (see _lossless)
    cover: dict[int, int] = {}
    for i, (lo, hi) in enumerate(offsets):
        cover.update((c, i) for c in range(lo, hi))
        last = owner.get(hi - 1) if hi > lo else None
        if last is not None and last[0] != "other":  # a content token reaches out only over spaces
            assert all(
                text[c].isspace() or owner.get(c, ("", -1))[1] == last[1] for c in range(lo, hi)
            )
    for c, (_, message) in owner.items():
        if not text[c].isspace():  # never absorbed into a template token
            lo, hi = offsets[cover[c]]
            assert owner.get(hi - 1, ("", -1))[1] == message
    for lo, hi, kind, message in oracle.ranges:  # a one-segment message decodes to its text
        if kind == "other" or sum(r[3] == message for r in oracle.ranges) != 1:
            continue
        mine = [i for i, (a, b) in enumerate(offsets) if b > a and lo <= b - 1 < hi]
        assert mine == list(range(mine[0], mine[-1] + 1)) if mine else True
        decoded = tokenizer.decode(
            [p.token_ids[i] for i in mine], clean_up_tokenization_spaces=False
        )
        assert decoded.strip() == text[lo:hi].strip()


@FUZZ
@given(request=PAIR_OR_PLAIN)
def test_pairs_and_plain_strings(model, request):
    _check(model, request)


@FUZZ
@given(request=CHAT)
def test_chat_messages_with_mixed_roles_and_segments(model, request):
    _check(model, request)
