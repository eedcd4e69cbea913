"""A byte-level BPE encoding's character offsets, computed from its token ids alone.

Asking the tokenizer for offsets costs about a third of its encode (it aligns every token to
the input and converts byte offsets to characters), and turning them into Python tuples costs
more. For a byte-level BPE tokenizer each token id stands for a fixed byte string, so where the
ids' bytes, joined, are exactly the text's UTF-8 bytes, token ``i`` covers the bytes from the
sum of the lengths before it: its offsets follow from the ids.

That holds only for some tokenizer shapes, checked once per tokenizer (``byte_table``): no
normalizer that could change text (none, or NFC, which changes nothing that the byte check
lets through), a byte-level pre-tokenizer that adds no prefix space after splits that keep
every character, BPE without dropout or word affixes, no post-processor that trims offsets, and
added tokens that strip nothing. Then every encoding is checked (``char_offsets``): the ids'
bytes must spell the text exactly, or None is returned and the caller asks the tokenizer for
offsets (text the tokenizer changes or drops, such as the bytes some vocabularies lack, takes
that path). Tests compare the offsets with the tokenizer's own on many texts.

Example (the two bytes of "é" in two tokens: each is given the whole character):
    >>> pieces = [b"h", b"\\xc3", b"\\xa9", b"llo"]
    >>> table = ByteTable(pieces, np.array([len(p) for p in pieces]))
    >>> char_offsets(table, "h\\u00e9llo", [0, 1, 2, 3]).tolist()
    [[0, 1], [1, 2], [1, 2], [2, 5]]
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Digits"})
# post-processors that add nothing and move no offset when called without special tokens
_QUIET_POST_PROCESSORS = frozenset({"TemplateProcessing", "BertProcessing", "RobertaProcessing"})


@dataclass(frozen=True)
class ByteTable:
    """Each token id's bytes (``pieces[id]``) and their length (``lengths[id]``)."""

    pieces: list[bytes]
    lengths: np.ndarray  # int64, one per id


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, reversed."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in kept}
    moved = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return {c: b for b, c in chars.items()}


def _is_byte_level(pre: dict[str, Any] | None) -> bool:
    """A ByteLevel pre-tokenizer without prefix space, after splits that keep every character."""
    if pre is None:
        return False
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    *splits, last = steps or [{}]
    return (
        last.get("type") == "ByteLevel"
        and last.get("add_prefix_space") is False
        and all(s.get("type") in _SPLITTING_PRE_TOKENIZERS for s in splits)
        and all(s.get("behavior") != "Removed" for s in splits)
    )


def _keeps_offsets(post: dict[str, Any] | None) -> bool:
    """A post-processor that, without special tokens, changes no offset (ByteLevel's
    ``trim_offsets`` would trim a token's leading space from its offsets)."""
    if post is None:
        return True
    if post.get("type") == "Sequence":
        return all(_keeps_offsets(p) for p in post.get("processors", []))
    if post.get("type") == "ByteLevel":
        return post.get("trim_offsets") is False
    return post.get("type") in _QUIET_POST_PROCESSORS


def _plain_bpe(model: dict[str, Any]) -> bool:
    return (
        model.get("type") == "BPE"
        and model.get("dropout") is None
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
    )


def byte_table(backend: Any) -> ByteTable | None:
    """The byte table of a ``tokenizers.Tokenizer``, or None when its shape does not make
    offsets follow from ids (see the module's docstring)."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # not a tokenizers.Tokenizer, or one that cannot be serialised
        return None
    normalizer = spec.get("normalizer")
    added = spec.get("added_tokens") or []
    if (
        (normalizer is not None and normalizer.get("type") != "NFC")
        or not _is_byte_level(spec.get("pre_tokenizer"))
        or not _plain_bpe(spec.get("model") or {})
        or not _keeps_offsets(spec.get("post_processor"))
        or any(t.get("lstrip") or t.get("rstrip") for t in added)
    ):
        return None
    decoder = _byte_decoder()
    pieces: dict[int, bytes] = {}
    for token, i in spec["model"]["vocab"].items():
        if not token or any(c not in decoder for c in token):
            return None  # not a byte-level vocabulary
        pieces[int(i)] = bytes(decoder[c] for c in token)
    for token in added:
        content = str(token["content"]).encode("utf-8")
        if not content or pieces.setdefault(int(token["id"]), content) != content:
            return None  # an added token whose id the model spells otherwise: ambiguous
    table = [b""] * (max(pieces, default=-1) + 1)
    for i, piece in pieces.items():
        table[i] = piece
    if not all(table):
        return None  # a gap in the ids
    return ByteTable(table, np.fromiter(map(len, table), dtype=np.int64, count=len(table)))


def char_offsets(table: ByteTable, text: str, ids: list[int]) -> np.ndarray | None:
    """Each token's character offsets ``[tokens, 2]`` (start, end), exactly as the tokenizer
    reports them, or None when the ids' bytes do not spell ``text``.

    A token that covers part of a character's bytes (byte-level BPE may split one) is given the
    whole character, as the tokenizer does.
    """
    data = text.encode("utf-8")
    try:
        if b"".join(map(table.pieces.__getitem__, ids)) != data:
            return None
    except (IndexError, TypeError):  # an id the table does not know
        return None
    lengths = table.lengths[np.fromiter(ids, dtype=np.int64, count=len(ids))]
    bounds = np.empty((len(ids), 2), dtype=np.int64)
    np.cumsum(lengths, out=bounds[:, 1])
    bounds[:, 0] = bounds[:, 1] - lengths
    if len(data) == len(text):  # ASCII: bytes are characters
        return bounds
    # the character holding each byte: a byte starts a character unless it is 0b10xxxxxx
    char_of = np.cumsum((np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80) - 1
    bounds[:, 0] = char_of[bounds[:, 0]]
    bounds[:, 1] = char_of[bounds[:, 1] - 1] + 1
    return bounds
