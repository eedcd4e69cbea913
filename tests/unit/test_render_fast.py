"""Encoding a rendered request in pieces (``chunked_encode``) equals encoding it whole.

The reference is the tokenizer's own encoding of the whole text (``tokenizers`` directly, and
transformers' ``tokenizer(text)`` for whole requests): ids and character offsets must be equal
for every text, including texts with control-token strings, emoji, contractions, digits and
whitespace runs at the cuts. Small piece sizes make many cuts per text.
"""

from __future__ import annotations

import functools
import json
import random
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import pytest

from guardrail.probe import prompts
from guardrail.probe.chunked_encode import _CUT, chunkable, chunked, cuts
from guardrail.probe.prompts import PreparedPrompt, prepare_prompts

PIECES = [
    "the",
    " report",
    " it's",
    " don't",
    " we'll",
    "Hello",
    " world",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    " 12,5%",
    "2026",
    " (x)",
    ".",
    ", ",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "user\n",
    "😀",
    " é",
    "naïve",
    " 東京",
    "\u00a0",
    "\u200b",
    "\r\n",
    " a",
    "b",
    " Z",
    "'s",
    "'S",
    " _",
    "-",
    "x" * 40,
]


@lru_cache(maxsize=4)
def _load(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(params=["tiny_llama_dir", "smollm2_dir"])
def chunkable_tokenizer(request) -> Any:
    """The byte-level tokenizers that are encoded in pieces: tiny Llama's and SmolLM2's."""
    return _load(str(request.getfixturevalue(request.param)))


def _texts(count: int, seed: int, pieces: list[str] = PIECES) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        chosen = rng.choices(pieces, k=rng.randint(1, 400))
        texts.append("".join(chosen))
    return texts


def _whole(backend: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoding = backend.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets


def test_the_byte_level_tokenizers_are_chunkable_and_qwen2s_is_not(
    chunkable_tokenizer, tiny_qwen2_dir
):
    assert chunkable(chunkable_tokenizer.backend_tokenizer)
    # a normalizer (NFC) and its own split regex: encoded whole
    assert not chunkable(_load(str(tiny_qwen2_dir)).backend_tokenizer)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("normalizer", {"type": "NFC"}),
        ("pre_tokenizer", {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}),
        ("pre_tokenizer", {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}),
        ("post_processor", {"type": "ByteLevel", "trim_offsets": True}),
    ],
)
def test_any_other_shape_is_not_chunkable(tiny_llama_dir, field, value):
    from tokenizers import Tokenizer

    spec = json.loads(_load(str(tiny_llama_dir)).backend_tokenizer.to_str())
    spec[field] = {**value, **({"add_prefix_space": False} if field == "post_processor" else {})}
    spec[field].setdefault("trim_offsets", True)
    assert not chunkable(Tokenizer.from_str(json.dumps(spec)))


def test_an_added_token_with_a_space_or_stripping_is_not_chunkable(tiny_llama_dir):
    from tokenizers import AddedToken, Tokenizer

    backend = _load(str(tiny_llama_dir)).backend_tokenizer
    for token in [AddedToken("a b", special=True), AddedToken("<x>", lstrip=True, special=True)]:
        copy = Tokenizer.from_str(backend.to_str())
        copy.add_special_tokens([token])
        assert not chunkable(copy)


@pytest.mark.parametrize("size", [1, 3, 16, 64])
def test_cuts_are_spaces_between_ascii_letters_far_enough_apart(size):
    for text in _texts(200, seed=size):
        points = cuts(text, size)
        for previous, point in zip([0, *points], points, strict=False):
            assert text[point] == " " and text[point - 1].isascii() and text[point + 1].isascii()
            assert text[point - 1].isalpha() and text[point + 1].isalpha()
            assert point - previous >= size
            assert _CUT.match(text, point)
        if points:
            assert len(text) - points[-1] >= size


@pytest.mark.parametrize("size", [1, 2, 8, 64, 512])
def test_pieces_give_the_whole_texts_ids_and_offsets(chunkable_tokenizer, size):
    backend = prompts._private_backend(chunkable_tokenizer, encode_special_tokens=False)
    encode = chunked(functools.partial(backend.encode, add_special_tokens=False), size, min_chars=0)
    texts = _texts(300, seed=size)
    assert sum(len(cuts(t, size)) for t in texts) > 100  # the test does cut
    for text in texts:
        assert encode(text) == _whole(backend, text)


def test_pool_rows_in_pieces_give_the_whole_texts_ids(chunkable_tokenizer):
    from guardrail.offline.pool import load_pool

    backend = prompts._private_backend(chunkable_tokenizer, encode_special_tokens=False)
    encode = chunked(functools.partial(backend.encode, add_special_tokens=False), 16, min_chars=0)
    rows = load_pool(more_layouts=0)[::5]
    for row in rows:
        text = f"<|im_start|>system\n{row.instruction}<|im_end|>\n<|im_start|>user\n{row.data}"
        assert encode(text) == _whole(backend, text)


def _requests(count: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    requests: list[Any] = []
    # one request in four may spell control tokens in its content
    plain = [p for p in PIECES if "<|" not in p]
    texts = [t for k in range(4) for t in _texts(count // 4, seed + k, PIECES if k == 3 else plain)]
    for i, text in enumerate(texts):
        data = text * rng.randint(4, 12)
        if i % 3 == 0:
            requests.append((f"Summarize item {i}.", data))
        elif i % 3 == 1:
            messages = [
                {"role": "system", "content": "Be careful."},
                {"role": "user", "content": f"Look at {i}."},
                {"role": "tool", "content": data},
                {"role": "user", "content": "Answer."},
            ]
            requests.append(messages)
        else:
            requests.append([{"role": "user", "content": f"Read this {data}"}])
    return requests


def test_prepared_prompts_equal_the_tokenizers_whole_encoding(chunkable_tokenizer):
    """Long requests, one at a time (encoded in pieces) and batched (encoded whole): the same
    prompts; ids are the tokenizer's own encoding of the rendered text unless content spells a
    control token, and spans follow from the tokenizer's own offsets."""
    requests = _requests(60, seed=7)
    results = [prepare_prompts([r], chunkable_tokenizer)[0] for r in requests]  # in pieces
    assert results == prepare_prompts(requests, chunkable_tokenizer)  # a batch: encoded whole
    checked = 0
    for request, prepared in zip(requests, results, strict=True):
        assert isinstance(prepared, PreparedPrompt)
        rendered = prompts._rendered(request, chunkable_tokenizer)
        assert rendered.text == prepared.text
        if any("<|" in s.text for s in prepared.segments):
            continue  # content spelling a control token is tokenized as text: not the whole's
        encoded = chunkable_tokenizer(
            prepared.text, add_special_tokens=False, return_offsets_mapping=True
        )
        offsets = [tuple(o) for o in encoded["offset_mapping"]]
        assert prepared.token_ids == list(encoded["input_ids"])
        kinds = prompts._token_kinds(offsets, rendered.ranges)
        assert prepared.data_spans == prompts._runs(kinds == 2)
        assert prepared.instruction_spans == prompts._runs(kinds == 1)
        checked += 1
    assert checked >= 40


def test_pieces_encoded_on_threads_equal_the_whole(chunkable_tokenizer, monkeypatch):
    """One long request with encoding threads: its pieces are encoded on them, same result."""
    requests = _requests(8, seed=11)
    serial = prepare_prompts(requests, chunkable_tokenizer)
    mapped: list[int] = []

    class Pool:  # the encoding threads, counting what they encode
        def __init__(self) -> None:
            self.threads = ThreadPoolExecutor(2)

        def map(self, function: Any, items: list[str]) -> Any:
            mapped.append(len(items))
            return self.threads.map(function, items)

    pool = Pool()
    monkeypatch.setattr(prompts, "_encode_pool", lambda: pool)
    for request, expected in zip(requests, serial, strict=True):
        assert prepare_prompts([request], chunkable_tokenizer) == [expected]
    pool.threads.shutdown()
    assert len(mapped) >= 4 and max(mapped) > 2  # long texts went to the threads in pieces
