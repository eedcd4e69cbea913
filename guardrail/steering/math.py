"""Activation steering for instruction following: the math, pure functions on tensors.

A steering vector is a unit direction ``u`` in the residual stream at one decoder layer plus
``avg_proj``, the mean projection on ``u`` of residuals taken *with* the instruction in the
prompt (Stolfo et al., "Improving Instruction-Following in Language Models through
Activation Steering", ICLR 2025). Applied at that layer, on every position:

- ``add_vector``: ``s + c * u``;
- ``adjust_rs``:  ``s + (c * avg_proj - s . u) * u`` (sets the projection on ``u``, c = 1 sets
  it to ``avg_proj`` exactly).

``s`` is the residual *stream*: in vLLM a decoder layer returns ``(hidden_states, residual)``
and the stream is their sum, so the worker computes a delta from ``h + r`` and adds it to one
of the two (see ``guardrail.worker.steering``). The functions here never mutate their inputs.

Example:
    >>> u = torch.tensor([1.0, 0.0])
    >>> add_vector(torch.tensor([[0.5, 2.0]]), u, 3.0)
    tensor([[3.5000, 2.0000]])
    >>> adjust_rs(torch.tensor([[0.5, 2.0]]), u, avg_proj=4.0)
    tensor([[4., 2.]])
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = ["SteeringMethod", "add_vector", "adjust_rs", "direction_from_pairs", "steering_delta"]

SteeringMethod = Literal["add_vector", "adjust_rs"]


def add_vector(stream: torch.Tensor, direction: torch.Tensor, coefficient: float) -> torch.Tensor:
    """``stream + coefficient * direction``.

    Shapes: stream [tokens, hidden]; direction [hidden] (unit norm). Returns [tokens, hidden].

    Example:
        >>> add_vector(torch.zeros(2, 3), torch.tensor([0.0, 1.0, 0.0]), 2.0)[1]
        tensor([0., 2., 0.])
    """
    return stream + steering_delta(stream, direction, "add_vector", coefficient, 0.0)


def adjust_rs(
    stream: torch.Tensor, direction: torch.Tensor, avg_proj: float, coefficient: float = 1.0
) -> torch.Tensor:
    """Set every row's projection on ``direction`` to ``coefficient * avg_proj``.

    Shapes: stream [tokens, hidden]; direction [hidden] (unit norm). Returns [tokens, hidden];
    the component orthogonal to ``direction`` is unchanged.

    Example:
        >>> out = adjust_rs(torch.tensor([[3.0, 1.0]]), torch.tensor([0.6, 0.8]), 5.0)
        >>> round(float(out[0] @ torch.tensor([0.6, 0.8])), 4)
        5.0
    """
    return stream + steering_delta(stream, direction, "adjust_rs", coefficient, avg_proj)


def steering_delta(
    stream: torch.Tensor,
    direction: torch.Tensor,
    method: SteeringMethod,
    coefficient: float,
    avg_proj: float,
) -> torch.Tensor:
    """What steering adds to each row of the residual stream.

    Shapes: stream [tokens, hidden] (the stream ``h + r``, any float dtype); direction [hidden].
    Returns [tokens, hidden] in the stream's dtype; the projection is computed in float32.

    Example:
        >>> s = torch.tensor([[1.0, 5.0]]); u = torch.tensor([0.0, 1.0])
        >>> steering_delta(s, u, "adjust_rs", 1.0, 2.0)[0, 1].item()  # projection 5 -> 2
        -3.0
    """
    u = direction.to(device=stream.device, dtype=torch.float32)
    if method == "add_vector":
        delta = (coefficient * u).expand(stream.shape[0], -1)
    elif method == "adjust_rs":
        projection = stream.float() @ u  # [tokens]
        delta = (coefficient * avg_proj - projection).unsqueeze(-1) * u
    else:
        raise ValueError(f"unknown steering method {method!r}; use 'add_vector' or 'adjust_rs'")
    return delta.to(stream.dtype)


def direction_from_pairs(
    with_instruction: torch.Tensor, without_instruction: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Stolfo et al.'s vector: ``u`` = normalised mean difference, ``avg_proj`` = mean of
    ``with_instruction @ u``.

    Shapes: both [pairs, hidden] (residual stream at one layer, last prompt token, row i of
    each from the same example). Returns (u [hidden] float32, avg_proj).

    Example:
        >>> u, p = direction_from_pairs(torch.tensor([[2.0, 1.0]]), torch.tensor([[0.0, 1.0]]))
        >>> u.tolist(), p
        ([1.0, 0.0], 2.0)
    """
    if with_instruction.shape != without_instruction.shape or with_instruction.ndim != 2:
        raise ValueError(
            f"expected two [pairs, hidden] tensors of one shape, got "
            f"{tuple(with_instruction.shape)} and {tuple(without_instruction.shape)}"
        )
    with_f, without_f = with_instruction.float(), without_instruction.float()
    diff = (with_f - without_f).mean(0)
    norm = float(diff.norm())
    if not math.isfinite(norm) or norm == 0.0:
        raise ValueError("the two sets have the same mean: no direction to steer along")
    u = diff / norm
    return u, float((with_f @ u).mean())
