"""Independent reference: Attention Tracker scores from Hugging Face eager attention.

Runs the same weights and token ids through transformers with ``attn_implementation="eager"``
and ``output_attentions=True``, and reads the last token's attention rows directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch


@lru_cache(maxsize=2)
def _load(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@lru_cache(maxsize=64)
def _last_token_attention(model_dir: str, token_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """Per layer, the attention rows [heads, tokens] of the last token (eager, float32)."""
    model = _load(model_dir)
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), output_attentions=True)
    return [layer[0, :, -1].double() for layer in out.attentions]


def hf_head_stats(
    model_dir: str,
    token_ids: Sequence[int],
    instruction_spans: Sequence[tuple[int, int]],
    data_spans: Sequence[tuple[int, int]],
    heads: Sequence[tuple[int, int]],
) -> dict[tuple[int, int], list[float]]:
    """Attention stats per head (instruction, data and sink mass, largest data token, data
    entropy / log(data tokens)) from HF eager attention of the last prompt token."""
    rows = _last_token_attention(model_dir, tuple(token_ids))
    instr = [i for a, b in instruction_spans for i in range(a, b)]
    data = [i for a, b in data_spans for i in range(a, b)]
    stats = {}
    for layer, head in heads:
        row = rows[layer][head].tolist()
        on_data = [row[i] for i in data]
        total = sum(on_data)
        entropy = 0.0
        if len(on_data) > 1:
            shares = [x / total for x in on_data]
            entropy = -sum(x * math.log(x) for x in shares if x > 0) / math.log(len(on_data))
        stats[(layer, head)] = [
            sum(row[i] for i in instr),
            total,
            row[0],
            max(on_data, default=0.0),
            entropy,
        ]
    return stats


def hf_head_scores(
    model_dir: str,
    token_ids: Sequence[int],
    instruction_spans: Sequence[tuple[int, int]],
    data_spans: Sequence[tuple[int, int]],
    heads: Sequence[tuple[int, int]],
) -> dict[tuple[int, int], float]:
    """Focus per (layer, head) from HF eager attention of the last prompt token."""
    stats = hf_head_stats(model_dir, token_ids, instruction_spans, data_spans, heads)
    return {h: on_i / (on_i + on_d + 1e-8) for h, (on_i, on_d, *_) in stats.items()}
