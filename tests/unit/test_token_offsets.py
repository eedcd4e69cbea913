"""Offsets computed from token ids (``guardrail.probe.token_offsets``) against the tokenizer's own,
on the tiny models' tokenizers and (slow) SmolLM2's, and the shapes where they do not apply."""

from __future__ import annotations

import json
import random
from functools import lru_cache
from typing import Any

import pytest

from guardrail.probe.token_offsets import byte_table, char_offsets

# pieces of hostile and awkward text: control-token strings, template markup, placeholder-like
# text, characters of 2-4 UTF-8 bytes, combining marks, text NFC changes, bytes some
# vocabularies lack (C0 controls, U+40000 and above), whitespace runs
PIECES = [
    *"abc XYZ\n\t\r.,!?'\"",
    "é", "ß", "日本語", "😀", "👍🏽", "\u0301", "e\u0301", "\u212b", "\u00a0", "\u2028",
    "\x00", "\x01", "\x7f", "\U00040000", "\U0010ffff", "\ue000", "\ue000ab12.0\ue001",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\n", "<repo_name>",
    "Ġ", "Ċ", "﷽", "ﬁ", "  \n\n ", "'s", "123", "Data: ",
]  # fmt: skip

TOKENIZERS = [
    "tiny_llama_dir",
    "tiny_qwen2_dir",
    pytest.param("smollm2_dir", marks=pytest.mark.slow),
]


@lru_cache(maxsize=4)
def _backend(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).backend_tokenizer


@pytest.fixture(params=TOKENIZERS)
def backend(request: pytest.FixtureRequest) -> Any:
    return _backend(str(request.getfixturevalue(request.param)))


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(PIECES, k=rng.randint(0, 40))) for _ in range(count)]


def test_offsets_from_ids_are_the_tokenizers_own(backend: Any) -> None:
    """Where the ids spell the text, the offsets are exactly the tokenizer's (a token covering
    part of a character included); None exactly where the tokenizer does not give the text back
    (it normalized or dropped some of it)."""
    table = byte_table(backend)
    assert table is not None
    computed = 0
    for text in _texts(1500):
        encoding = backend.encode(text, add_special_tokens=False)
        assert backend.encode_batch_fast([text], add_special_tokens=False)[0].ids == encoding.ids
        got = char_offsets(table, text, encoding.ids)
        spelled = backend.decode(encoding.ids, skip_special_tokens=False) == text
        assert (got is not None) == spelled, text.encode("unicode_escape")
        if got is not None:
            assert [tuple(pair) for pair in got.tolist()] == encoding.offsets
            computed += 1
    assert computed > 500  # most texts take the fast way


def test_offsets_of_a_long_ascii_and_a_long_multibyte_text(backend: Any) -> None:
    table = byte_table(backend)
    assert table is not None
    for text in ["the quick brown fox, 12.5% " * 400, "日本語のテキスト 😀 é " * 300]:
        encoding = backend.encode(text, add_special_tokens=False)
        got = char_offsets(table, text, encoding.ids)
        assert got is not None and [tuple(p) for p in got.tolist()] == encoding.offsets


def test_ids_that_do_not_spell_the_text_give_none(backend: Any) -> None:
    table = byte_table(backend)
    assert table is not None
    ids = backend.encode("hello world", add_special_tokens=False).ids
    assert char_offsets(table, "hello world", ids) is not None
    assert char_offsets(table, "hello worle", ids) is None
    assert char_offsets(table, "hello world", [*ids, ids[0]]) is None
    assert char_offsets(table, "hello world", ids[:-1]) is None
    assert char_offsets(table, "hello world", [*ids[:-1], len(table.pieces) + 5]) is None
    assert char_offsets(table, "", []) is not None


def _changed(backend: Any, change: Any) -> Any:
    """A copy of ``backend`` with ``change`` applied to its JSON form."""
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def _trim_offsets(spec: dict[str, Any]) -> None:
    spec["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }


def _prefix_space(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"]["add_prefix_space"] = True


def _lowercase(spec: dict[str, Any]) -> None:
    spec["normalizer"] = {"type": "Lowercase"}


def _rstrip(spec: dict[str, Any]) -> None:
    spec["added_tokens"][1]["rstrip"] = True


def _dropout(spec: dict[str, Any]) -> None:
    spec["model"]["dropout"] = 0.5


@pytest.mark.parametrize("change", [_trim_offsets, _prefix_space, _lowercase, _rstrip, _dropout])
def test_shapes_where_offsets_do_not_follow_from_ids_get_no_table(
    tiny_llama_dir: Any, change: Any
) -> None:
    backend = _backend(str(tiny_llama_dir))
    assert byte_table(backend) is not None
    assert byte_table(_changed(backend, change)) is None


def test_a_trimming_post_processor_really_moves_offsets(tiny_llama_dir: Any) -> None:
    """Why such a shape is refused: the ids spell the text, yet the offsets are not where the
    ids' bytes are (ByteLevel's ``trim_offsets`` drops a token's leading space)."""
    backend = _backend(str(tiny_llama_dir))
    table = byte_table(backend)
    assert table is not None
    trimmed = _changed(backend, _trim_offsets)
    encoding = trimmed.encode("hello big world", add_special_tokens=False)
    got = char_offsets(table, "hello big world", encoding.ids)
    assert got is not None and [tuple(p) for p in got.tolist()] != encoding.offsets


def test_a_non_byte_level_tokenizer_gets_no_table() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    assert byte_table(tokenizer) is None
    assert byte_table(object()) is None
