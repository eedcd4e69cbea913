"""How a request is steered, and what steering did: plain data shared by engine and policies.

Example:
    >>> Steering(vector="SmolLM2-135M-Instruct", coefficient=4.0).method is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from guardrail.steering.math import SteeringMethod
from guardrail.strict import ConfigModel, FiniteNumber

__all__ = ["Steering", "SteeringLike", "SteeringReport"]


class Steering(ConfigModel):
    """How one request is steered: a loaded vector's name, and optionally a method and
    coefficient overriding the vector file's defaults. The coefficient is a finite number (a
    bool, a string, NaN or infinity is a ``ConfigError`` naming the field).

    Example:
        >>> Steering(vector="v", method="adjust_rs").coefficient is None
        True
        >>> Steering(vector="v", coefficient=float("nan"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        guardrail.errors.ConfigError: invalid Steering: coefficient = nan: must be a finite ...
    """

    vector: str
    method: SteeringMethod | None = None
    coefficient: FiniteNumber | None = None


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
