"""Logprobs in OpenAI's shapes, against vLLM's own server code: positions are built by vLLM's
own builder (``append_logprobs_for_next_position``, as its output processor builds them) and
rendered by this server and by ``vllm serve``'s renderers (``_create_chat_logprobs``,
``_create_completion_logprobs``) on the same input."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from guardrail.integrations._openai_logprobs import (
    FLOOR,
    RequestLogprobs,
    chat_logprobs,
    completion_logprobs,
)

from guardrail.engine.types import TokenLogprob, logprobs_of

VOCAB = {1: "a", 2: "b", 3: " c", 4: "é", 5: "d"}
RANKED = [1, 2, 3, 4, 5]  # the most likely first, at every position
LOGPROBS = {1: -0.25, 2: -1.5, 3: -2.0, 4: -3.0, 5: float("-inf")}


def _vllm_positions(sampled: list[int], top: int) -> list[Any]:
    """vLLM's sample logprobs for ``sampled`` tokens, built by vLLM's own code: the sampled
    token first with its rank, then the ``top`` most likely."""
    from vllm.logprobs import append_logprobs_for_next_position

    positions: list[Any] = []
    for token in sampled:
        ids = [token, *RANKED[:top]]
        append_logprobs_for_next_position(
            positions,
            ids,
            [LOGPROBS[t] for t in ids],
            [VOCAB[t] for t in ids],
            RANKED.index(token) + 1,
            top,
        )
    return positions


def _vllm_chat(sampled: list[int], positions: list[Any], top: int) -> Any:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    server = object.__new__(OpenAIServingChat)  # its renderer reads only this setting
    server.return_tokens_as_token_ids = False
    return server._create_chat_logprobs(sampled, positions, None, top).model_dump()


def _vllm_completion(sampled: list[int], positions: list[Any], top: int, offset: int = 0) -> Any:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    server = object.__new__(OpenAIServingCompletion)
    server.return_tokens_as_token_ids = False
    rendered = server._create_completion_logprobs(
        sampled, positions, top, None, initial_text_offset=offset
    )
    return rendered.model_dump()


def _ours(positions: list[Any]) -> Any:
    return logprobs_of(SimpleNamespace(logprobs=positions))


GREEDY = [1, 1, 1]
SAMPLED = [1, 3, 5, 4]  # ranks 1, 3, 5, 4: inside and outside the top lists


@pytest.mark.parametrize("top", [0, 1, 3, 5])
def test_greedy_chat_logprobs_are_vllm_serves(top: int) -> None:
    positions = _vllm_positions(GREEDY, top)
    assert chat_logprobs(GREEDY, _ours(positions), top) == _vllm_chat(GREEDY, positions, top)


@pytest.mark.parametrize("sampled", [GREEDY, SAMPLED])
@pytest.mark.parametrize("top", [0, 2, 5])
def test_completion_logprobs_are_vllm_serves(sampled: list[int], top: int) -> None:
    positions = _vllm_positions(sampled, top)
    for offset in (0, 7):
        ours = completion_logprobs(sampled, _ours(positions), top, offset)
        assert ours == _vllm_completion(sampled, positions, top, offset)


def test_a_sampled_chat_token_outside_the_top_keeps_the_top_in_rank_order() -> None:
    """OpenAI's meaning: ``top_logprobs`` are the N most likely tokens. vLLM's list puts the
    sampled token first, so a token sampled outside the top N pushes the Nth out."""
    top = 2
    positions = _vllm_positions(SAMPLED, top)
    ours = chat_logprobs(SAMPLED, _ours(positions), top)["content"]
    theirs = _vllm_chat(SAMPLED, positions, top)["content"]
    for mine, vllm_entry, token in zip(ours, theirs, SAMPLED, strict=True):
        assert [t["token"] for t in mine["top_logprobs"]] == ["a", "b"]
        assert {k: v for k, v in mine.items() if k != "top_logprobs"} == {
            k: v for k, v in vllm_entry.items() if k != "top_logprobs"
        }
        if RANKED.index(token) >= top:  # vLLM's differs exactly here
            assert vllm_entry["top_logprobs"][0]["token"] == VOCAB[token]
    assert ours[0] == theirs[0]  # sampled the most likely: the same


def test_minus_infinity_is_the_floor_and_bytes_are_utf8() -> None:
    positions = _ours(_vllm_positions([5, 4], 0))
    content = chat_logprobs([5, 4], positions, 0)["content"]
    assert [c["logprob"] for c in content] == [FLOOR, -3.0]
    assert content[1]["bytes"] == [0xC3, 0xA9]


def test_a_token_without_text_or_entry_is_rendered_as_vllm_does() -> None:
    """No text from the engine: vLLM's ``token_id:ID`` placeholder; no entry for the token: the
    floor and no alternatives (chat), no logprob (completions)."""
    nameless = ((TokenLogprob(9, -0.5, 1, None),),)
    assert chat_logprobs([9], nameless, 1)["content"][0]["token"] == "token_id:9"
    missing = chat_logprobs([9, 8], nameless, 1)["content"][1]
    assert (missing["logprob"], missing["top_logprobs"]) == (FLOOR, [])
    legacy = completion_logprobs([9, 8], nameless, 1)
    assert legacy["token_logprobs"] == [-0.5, None] and legacy["top_logprobs"][1] is None


def test_a_streamed_completion_continues_its_text_offsets() -> None:
    positions = _ours(_vllm_positions(SAMPLED, 2))
    whole = completion_logprobs(SAMPLED, positions, 2)
    stream = RequestLogprobs(chat=False, top=2)
    chunks = [stream.render(SAMPLED[:1], positions[:1]), stream.render(SAMPLED[1:], positions[1:])]
    assert [o for c in chunks for o in c["text_offset"]] == whole["text_offset"]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
