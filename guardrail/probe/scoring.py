"""Attention Tracker score math: pure functions over tensors, no model, no vLLM.

The probe computes, for the query of the last prompt token, the softmax over all prompt keys
of one attention head, and how much of that attention lands on the trusted instruction versus
the untrusted data (Hung et al., "Attention Tracker"). These functions are used inside the
vLLM worker and by the calibration tools, so serving and calibration measure the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch

EPS = 1e-8

FOCUS = "focus"
"""The name of the attention probe's signal: the config's focus score in [0, 1], low = injection."""

HeadKey = tuple[int, int]
"""(layer, head), both 0-based, head counted over all query heads of the model."""


ATTENTION_STATS = ("instruction", "data", "sink", "data_max", "data_entropy")
"""What the probe reads per head from the last prompt token's attention row, in this order:
attention mass on the instruction, mass on the data, mass on the first prompt token (the
attention sink), the largest attention on any single data token, and the entropy of the
attention within the data divided by log(number of data tokens) (0 with fewer than 2)."""
INSTRUCTION, DATA = 0, 1


def head_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    kv_index: torch.Tensor,
    instruction_mask: torch.Tensor,
    data_mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-head :data:`ATTENTION_STATS` of the last prompt token's attention row.

    Shapes: q [heads, dim] (post-RoPE query of the last prompt token, one row per scored head);
    k [tokens, kv_heads, dim] (post-RoPE keys of all prompt tokens); kv_index [heads] (the kv
    head each query head reads, GQA); instruction_mask and data_mask [tokens] bool.
    Returns [heads, 5] float32 from a = softmax(q . K^T * scale) over all tokens (logits
    soft-capped when ``softcap`` is set).

    Example:
        >>> q = torch.zeros(1, 4); k = torch.zeros(3, 1, 4)
        >>> m_i = torch.tensor([True, False, False]); m_d = torch.tensor([False, True, True])
        >>> head_attention_stats(q, k, torch.tensor([0]), m_i, m_d, 0.5).round(decimals=4)
        tensor([[0.3333, 0.6667, 0.3333, 0.3333, 1.0000]])
    """
    keys = k.index_select(1, kv_index).float()  # [tokens, heads, dim]
    logits = torch.einsum("hd,thd->ht", q.float(), keys) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    attn = torch.softmax(logits, dim=-1)
    on_data = attn[:, data_mask]  # [heads, data tokens]
    data_mass = on_data.sum(-1)
    num_data = on_data.shape[1]
    if num_data:
        share = on_data / (data_mass[:, None] + EPS)
        entropy = -(share * torch.log(share + 1e-12)).sum(-1) / math.log(max(num_data, 2))
        data_max = on_data.max(-1).values
    else:
        entropy = data_max = torch.zeros_like(data_mass)
    on_instruction = attn.masked_fill(~instruction_mask, 0.0).sum(-1)
    return torch.stack([on_instruction, data_mass, attn[:, 0], data_max, entropy], dim=-1)


def batched_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    valid: torch.Tensor,
    instruction_mask: torch.Tensor,
    data_mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`head_attention_stats` for many requests at once, padded: a few kernels, no loop.

    Shapes: q [rows, heads, dim] (each row's last-prompt-token query, scored heads only); k
    [rows, heads, tokens, dim] (each row's keys, already gathered per scored head, padded to
    the longest row); valid, instruction_mask, data_mask [rows, tokens] bool (padding is not
    valid, and is in neither span). Returns [rows, heads, 5] float32, equal to
    :func:`head_attention_stats` row by row (up to float summation order).

    Example:
        >>> q = torch.zeros(2, 1, 4); k = torch.zeros(2, 1, 3, 4)
        >>> valid = torch.tensor([[True, True, True], [True, True, False]])
        >>> m_i = torch.tensor([[True, False, False], [True, False, False]])
        >>> m_d = torch.tensor([[False, True, True], [False, True, False]])
        >>> batched_attention_stats(q, k, valid, m_i, m_d, 0.5)[:, 0].round(decimals=4) + 0.0
        tensor([[0.3333, 0.6667, 0.3333, 0.3333, 1.0000],
                [0.5000, 0.5000, 0.5000, 0.5000, 0.0000]])
    """
    logits = batched_logits(q, k, scale, softcap)
    return stats_from_logits(logits, valid, instruction_mask, data_mask)


def batched_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Attention logits of each row's query over its keys, in float32: q [rows, heads, dim], k
    [rows, heads, tokens, dim] -> [rows, heads, tokens] (soft-capped when ``softcap``). One
    batched product (k as gathered, head-major, needs no copy to multiply)."""
    logits = torch.matmul(k.float(), q.float()[..., None])[..., 0] * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def stats_from_logits(
    logits: torch.Tensor,
    valid: torch.Tensor,
    instruction_mask: torch.Tensor,
    data_mask: torch.Tensor,
) -> torch.Tensor:
    """The five stats from logits [rows, heads, tokens] (``batched_logits``; heads of several
    layers may sit side by side) and masks [rows, tokens]: [rows, heads, 5] float32."""
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    attn = torch.softmax(logits, dim=-1)  # [rows, heads, tokens]
    on_data = attn * data_mask[:, None, :]
    data_mass = on_data.sum(-1)
    num_data = data_mask.sum(-1, keepdim=True)  # [rows, 1]
    share = on_data / (data_mass[..., None] + EPS)
    entropy = -(share * torch.log(share + 1e-12)).sum(-1) / torch.log(num_data.clamp(min=2))
    on_instruction = (attn * instruction_mask[:, None, :]).sum(-1)
    return torch.stack([on_instruction, data_mass, attn[..., 0], on_data.amax(-1), entropy], dim=-1)


def focus_of(stats: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Focus from attention stats (last axis :data:`ATTENTION_STATS`): I / (I + D + 1e-8).

    Example:
        >>> focus_of(np.array([[0.3, 0.1, 0.5, 0.1, 1.0]])).round(4).tolist()
        [0.75]
    """
    return stats[..., INSTRUCTION] / (stats[..., INSTRUCTION] + stats[..., DATA] + EPS)


def head_focus(head_stats: Mapping[HeadKey, Sequence[float]]) -> dict[HeadKey, float]:
    """Focus per head from each head's :data:`ATTENTION_STATS`.

    Example:
        >>> {h: round(f, 4) for h, f in head_focus({(2, 1): [0.3, 0.1, 0.5, 0.1, 1.0]}).items()}
        {(2, 1): 0.75}
    """
    # plain float arithmetic: the same IEEE doubles as focus_of on float64, without numpy per head
    return {
        h: float(s[INSTRUCTION]) / (float(s[INSTRUCTION]) + float(s[DATA]) + EPS)
        for h, s in head_stats.items()
    }


def mean_focus(head_scores: Mapping[HeadKey, float], heads: Sequence[HeadKey]) -> float:
    """The published Attention Tracker score: mean head focus over the important heads.

    Example:
        >>> mean_focus({(0, 1): 0.2, (3, 0): 0.6}, [(0, 1), (3, 0)])
        0.4
    """
    return sum(head_scores[h] for h in heads) / len(heads)


FeatureKind = Literal["focus", "logit_focus", "attention_stats"]
FEATURES_PER_HEAD: dict[str, int] = {"focus": 1, "logit_focus": 1, "attention_stats": 5}
"""How many weights a logistic probe has per head for each feature kind."""
LOGIT_EPS = 1e-4
"""Head focus is clipped to [LOGIT_EPS, 1 - LOGIT_EPS] before the logit transform."""
LOG_FLOOR = 1e-6
"""Attention masses are floored at LOG_FLOOR before their log is taken."""


def head_features(stats: np.ndarray, kind: FeatureKind) -> np.ndarray:
    """What a logistic probe weighs per head, from attention stats [..., heads, 5].

    Returns [..., heads * FEATURES_PER_HEAD[kind]], head-major (a head's features are
    adjacent, in the order of its weights in a config):

    - ``focus``: the head's focus; ``logit_focus``: logit(focus), clipped to
      [LOGIT_EPS, 1 - LOGIT_EPS] (focus piles up near 0 and 1; the logit spreads the ends);
    - ``attention_stats``: log instruction mass, log data mass, log sink mass, log largest
      data-token attention (each floored at LOG_FLOOR) and the normalised data entropy. The
      masses separately say more than their ratio, and the last two say whether the last token
      looks at one place in the data (an injected instruction) or reads it evenly.

    Serving (:func:`logistic_focus`) and calibration use this one function.

    Example:
        >>> s = np.array([[[0.6, 0.2, 0.2, 0.1, 0.9], [0.0, 0.5, 0.4, 0.5, 0.0]]])
        >>> head_features(s, "logit_focus").round(2).tolist()
        [[1.1, -9.21]]
        >>> head_features(s, "attention_stats").shape
        (1, 10)
    """
    if kind == "attention_stats":
        logs = np.log(np.maximum(stats[..., :4], LOG_FLOOR))
        features = np.concatenate([logs, stats[..., 4:5]], axis=-1)
        return np.asarray(features.reshape(*stats.shape[:-2], -1))
    focus = np.asarray(focus_of(stats))
    if kind == "focus":
        return focus
    clipped = np.clip(focus, LOGIT_EPS, 1.0 - LOGIT_EPS)
    return np.asarray(np.log(clipped / (1.0 - clipped)))


def logistic_focus(
    stats: np.ndarray,
    weights: Sequence[float],
    bias: float,
    feature: FeatureKind = "focus",
) -> float:
    """Learned weighting of head features, returned as a focus (1 - P(injection)).

    ``stats`` [heads, len(ATTENTION_STATS)] float64 holds each head's
    :data:`ATTENTION_STATS`; ``weights`` (heads * FEATURES_PER_HEAD[feature], head-major) and
    ``bias`` are a logistic regression predicting injection from the heads' features
    (:func:`head_features`); returning 1 - p keeps one convention for every probe kind: low =
    injection.

    Example:
        >>> round(logistic_focus(np.array([[1.0, 0.0, 0, 0, 0]]), [-2.0], 1.0), 4)
        0.7311
    """
    features = head_features(stats, feature)
    z = bias + float(np.dot(np.asarray(weights, dtype=np.float64), features))
    p_injection = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
    return 1.0 - p_injection


def spans_to_mask(
    spans: Sequence[tuple[int, int]], num_tokens: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Boolean mask [num_tokens] that is True inside the half-open token ranges ``spans``.

    Example:
        >>> spans_to_mask([(1, 3)], 4).tolist()
        [False, True, True, False]
    """
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for start, end in spans:
        mask[start:end] = True
    return mask
