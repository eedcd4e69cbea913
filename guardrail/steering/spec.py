"""How a request is steered, and what steering did: plain data shared by engine and policies.

Example:
    >>> Steering(vector="SmolLM2-135M-Instruct", coefficient=4.0).method is None
    True
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from guardrail.errors import ConfigError
from guardrail.steering.math import SteeringMethod

__all__ = [
    "FiniteNumber",
    "SchemaVersion",
    "SpecModel",
    "Steering",
    "SteeringLike",
    "SteeringReport",
    "WholeNumber",
]

# Strict numbers and readable errors for steering data. ``guardrail.probe.config`` has the same
# for probe configs and policies; the layering keeps probe and steering independent, so the few
# lines are repeated here rather than shared.


def _finite_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"must be a number, not {type(value).__name__}: write a plain number such as 1.5 "
            "(no quotes, not true/false)"
        )
    try:
        number = float(value)
    except OverflowError:
        raise ValueError("is too large for a float: use a finite number below 1e308") from None
    if not math.isfinite(number):
        raise ValueError("must be a finite number (NaN and infinity are not allowed)")
    return number


def _whole_number(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"must be a whole number, not {type(value).__name__}: write an integer such as 3 "
            "(no quotes, no decimal point)"
        )
    number = int(value)
    if abs(number) >= 2**63:
        raise ValueError(f"is too large ({number.bit_length()} bits): use a number below 2**63")
    return number


FiniteNumber = Annotated[float, BeforeValidator(_finite_number)]
"""A finite float field: ints and floats only (no bools, no strings, no NaN or infinity)."""
WholeNumber = Annotated[int, BeforeValidator(_whole_number)]
"""An int field: integers only (no bools, strings or floats), below 2**63 in size."""
SchemaVersion = Annotated[Literal[1], BeforeValidator(_whole_number)]
"""A file format version field: the integer 1 (not ``true``, not ``1.0``)."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        return _REPR.repr(value)
    except Exception:  # a huge int deep inside, a broken __repr__: never fail the message
        return f"<{type(value).__name__}>"


Problem = tuple[tuple[str, ...], str, str]
"""One bad field: (location, kind: extra / missing / object / value, text)."""


def _problems(exc: ValidationError, fields: Iterable[str]) -> list[Problem]:
    found: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
        if kind == "extra_forbidden":
            listed = len(loc) == 1  # a nested model has fields of its own
            found.append((loc, "extra", f"; valid fields: {', '.join(fields)}" if listed else ""))
        elif kind == "missing":
            found.append((loc, "missing", ""))
        elif not loc and kind not in ("model_type", "dict_type"):
            found.append((loc, "object", msg))
        else:
            found.append((loc, "value", f"= {_short(err.get('input'))}: {msg}"))
    return found


def _render(problem: Problem) -> str:
    loc, kind, text = problem
    where = ".".join(loc)
    if kind == "extra":
        return f"unknown field {where!r}: remove it or fix its spelling{text}"
    if kind == "missing":
        return f"{where}: required field missing: add it"
    if kind == "object":
        return f"{where}: {text}" if where else text
    return f"{where or 'value'} {text}"


class SpecModel(BaseModel):
    """A frozen pydantic model that refuses unknown fields and raises ``ConfigError`` naming each
    bad field (where, the value given, what was wrong), built in Python or validated from data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise type(self)._config_error(exc) from exc

    # This __init__ validates exactly as pydantic's own, so it is marked as such (RootModel marks
    # its __init__ the same way): nested models and the policy union then keep pydantic's path;
    # a custom __init__ would be called with each nested dict as keyword arguments.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise cls._config_error(exc) from exc

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            raise cls._config_error(exc) from exc

    @classmethod
    def _config_error(cls, exc: ValidationError) -> ConfigError:
        problems = _problems(exc, cls.model_fields)
        message = f"invalid {cls.__name__}: {'; '.join(_render(p) for p in problems)}"
        return ConfigError(message)


class Steering(SpecModel):
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
