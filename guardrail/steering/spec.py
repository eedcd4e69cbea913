"""How a request is steered, and what steering did: plain data shared by engine and policies.

Example:
    >>> Steering(vector="SmolLM2-135M-Instruct", coefficient=4.0).method is None
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from guardrail.steering.math import SteeringMethod

__all__ = ["Steering", "SteeringLike", "SteeringReport"]


class Steering(BaseModel):
    """How one request is steered: a loaded vector's name, and optionally a method and
    coefficient overriding the vector file's defaults.

    Example:
        >>> Steering(vector="v", method="adjust_rs").coefficient is None
        True
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    vector: str
    method: SteeringMethod | None = None
    coefficient: float | None = None

    @field_validator("coefficient")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError(f"coefficient must be finite, got {value}")
        return value


SteeringLike = Steering | str | Mapping[str, Any]
"""A request's steering: a ``Steering``, a loaded vector's name, or a dict of its fields."""


@dataclass(frozen=True)
class SteeringReport:
    """What steering did for one request: ``tokens_steered`` counts the positions the hook
    changed (prompt positions computed plus decode steps); ``error`` is set when the request
    was not (or not fully) steered."""

    vector: str
    method: SteeringMethod
    coefficient: float
    tokens_steered: int = 0
    error: str | None = None
