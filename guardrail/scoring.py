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

HeadKey = tuple[int, int]
"""(layer, head), both 0-based, head counted over all query heads of the model."""


def head_focus_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    kv_index: torch.Tensor,
    instruction_mask: torch.Tensor,
    data_mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-head focus of the last prompt token on the instruction span.

    Shapes: q [heads, dim] (post-RoPE query of the last prompt token, one row per scored head);
    k [tokens, kv_heads, dim] (post-RoPE keys of all prompt tokens); kv_index [heads] (the kv
    head each query head reads, GQA); instruction_mask and data_mask [tokens] bool.
    Returns [heads] float32: sum(a[instr]) / (sum(a[instr]) + sum(a[data]) + 1e-8), where
    a = softmax(q . K^T * scale) over all tokens (logits soft-capped when ``softcap`` is set).

    Example:
        >>> q = torch.zeros(1, 4); k = torch.zeros(3, 1, 4)
        >>> m_i = torch.tensor([True, False, False]); m_d = torch.tensor([False, True, True])
        >>> round(head_focus_scores(q, k, torch.tensor([0]), m_i, m_d, 0.5).item(), 4)
        0.3333
    """
    keys = k.index_select(1, kv_index).float()  # [tokens, heads, dim]
    logits = torch.einsum("hd,thd->ht", q.float(), keys) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    attn = torch.softmax(logits, dim=-1)
    on_instruction = attn.masked_fill(~instruction_mask, 0.0).sum(-1)
    on_data = attn.masked_fill(~data_mask, 0.0).sum(-1)
    return on_instruction / (on_instruction + on_data + EPS)


def mean_focus(head_scores: Mapping[HeadKey, float], heads: Sequence[HeadKey]) -> float:
    """The published Attention Tracker score: mean head focus over the important heads.

    Example:
        >>> mean_focus({(0, 1): 0.2, (3, 0): 0.6}, [(0, 1), (3, 0)])
        0.4
    """
    return sum(head_scores[h] for h in heads) / len(heads)


FeatureKind = Literal["focus", "logit_focus"]
LOGIT_EPS = 1e-4
"""Head focus is clipped to [LOGIT_EPS, 1 - LOGIT_EPS] before the logit transform."""


def head_features(scores: np.ndarray, kind: FeatureKind) -> np.ndarray:
    """What a logistic probe weighs per head: its focus, or logit(focus), elementwise.

    A head's focus is a share of attention, often near 0 or 1, where a few points mean a lot;
    the logit spreads those ends out (on SmolLM2 it raised held-out AUROC, docs/detection.md).
    Serving (:func:`logistic_focus`) and calibration use this one function.

    Example:
        >>> head_features(np.array([[0.5, 0.0]]), "logit_focus").round(2).tolist()
        [[0.0, -9.21]]
    """
    if kind == "focus":
        return scores
    clipped = np.clip(scores, LOGIT_EPS, 1.0 - LOGIT_EPS)
    return np.asarray(np.log(clipped / (1.0 - clipped)))


def logistic_focus(
    head_scores: Mapping[HeadKey, float],
    heads: Sequence[HeadKey],
    weights: Sequence[float],
    bias: float,
    feature: FeatureKind = "focus",
) -> float:
    """Learned weighting of head focus scores, returned as a focus (1 - P(injection)).

    ``weights`` and ``bias`` are a logistic regression predicting injection from the heads'
    features (:func:`head_features`); returning 1 - p keeps one convention for every probe
    kind: low = injection.

    Example:
        >>> round(logistic_focus({(0, 0): 1.0}, [(0, 0)], [-2.0], 1.0), 4)
        0.7311
    """
    features = head_features(np.array([head_scores[h] for h in heads], dtype=np.float64), feature)
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
