"""Encoding a long text in pieces, where that provably gives the ids and offsets of one call.

Most of the time to encode a rendered request goes to the byte-level pre-tokenizer, which
costs more per character on a long text than on a short one: a 2,000-token request encoded in
pieces of about 1,000 characters took some 10-15% less CPU on a 2-core test machine, and
its pieces can be encoded on several threads (``prompts._batch_encoder``), so one long request
is not left to one core. Pieces are cut only where the whole-text encoding certainly has a
boundary.

Why a cut is safe, for a tokenizer of exactly this shape (``chunkable``): no normalizer; the
``ByteLevel`` pre-tokenizer with its GPT-2 regex (``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``, no look-behind, and a look-ahead of one character) and no
prefix space; a BPE model without dropout (it works on each pre-token alone); no post-processor
that changes offsets; added tokens that hold no whitespace and strip nothing. A cut is made only
at an ASCII space between two ASCII letters: no alternative of the regex matches a letter then
a space, so a pre-token ends before the space and the next (`` ?\\p{L}+``) starts at it; no added
token can span it (none holds a space). Each piece then yields exactly the tokens the whole text
yields there, with offsets shifted by the piece's start. ``test_render_fast`` checks this
against whole-text encoding on many texts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

CHUNK_CHARS = 1024
"""A piece is cut at the first safe point at least this many characters in."""
MIN_CHUNKED_CHARS = 4096
"""A shorter text is encoded whole: around 2,000 characters (500 tokens) the cutting cost more
than it saved (measured, docs/rendering.md)."""
_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")

Encoding = tuple[list[int], list[tuple[int, int]]]  # token ids and their character offsets


def chunkable(backend: Any) -> bool:
    """Whether ``backend`` (a ``tokenizers.Tokenizer``) has the shape the module docstring
    describes, so that encoding pieces cut by ``cuts`` equals encoding the whole text."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # not a tokenizer we can read: never cut
        return False
    pre = spec.get("pre_tokenizer") or {}
    model = spec.get("model") or {}
    post = spec.get("post_processor")
    added = spec.get("added_tokens") or []
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex") is True
        and pre.get("add_prefix_space") is False
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and (post is None or post.get("type") == "TemplateProcessing")
        and all(
            not (token.get("lstrip") or token.get("rstrip") or token.get("single_word"))
            and not any(c.isspace() for c in str(token.get("content", " ")))
            and str(token.get("content", ""))
            for token in added
        )
    )


def cuts(text: str, size: int = CHUNK_CHARS) -> list[int]:
    """Where to cut ``text``: positions of safe spaces (``_CUT``), each at least ``size``
    characters after the previous cut (the start), and none within ``size`` of the end.

    Example:
        >>> cuts("one two three four", size=4)
        [7, 13]
    """
    points: list[int] = []
    start = 0
    while len(text) - start > 2 * size:
        found = _CUT.search(text, start + size)
        if found is None or len(text) - found.start() < size:
            break
        points.append(found.start())
        start = found.start()
    return points


def chunked(
    encode: Callable[[str], Any],
    size: int = CHUNK_CHARS,
    map_pieces: Callable[[Callable[[str], Any], list[str]], Iterable[Any]] = map,
    min_chars: int = MIN_CHUNKED_CHARS,
) -> Callable[[str], Encoding]:
    """``encode`` (one text to a ``tokenizers.Encoding``) applied to the pieces of a text cut at
    ``cuts``, the results joined: the ids and offsets ``encode`` gives for the whole text.
    ``map_pieces`` maps ``encode`` over the pieces, in order (a thread pool's ``map`` encodes
    one long text on several cores); a text shorter than ``min_chars`` is encoded whole."""

    def encode_in_pieces(text: str) -> Encoding:
        points = cuts(text, size) if len(text) >= min_chars else []
        if not points:
            whole = encode(text)
            return whole.ids, whole.offsets
        starts = [0, *points]
        pieces = [text[lo:hi] for lo, hi in zip(starts, [*points, len(text)], strict=True)]
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for lo, piece in zip(starts, map_pieces(encode, pieces), strict=True):
            ids += piece.ids
            offsets += [(a + lo, b + lo) for a, b in piece.offsets] if lo else piece.offsets
        return ids, offsets

    return encode_in_pieces
