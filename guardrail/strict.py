"""Strict, finite configuration fields and readable validation errors, shared by every model a
user writes or a file holds (probe configs, policies, retry settings, steering specs and files).

Lax pydantic takes ``true`` as 1.0, ``"0.5"`` as 0.5 and NaN / infinity as floats; these types
take numbers only (a bool is not a number, a string is never converted) and finite ones only,
from files and from Python alike. ``ConfigModel`` raises ``ConfigError`` naming each bad field.

Example:
    >>> class Knob(ConfigModel):
    ...     level: FiniteNumber = 0.5
    >>> Knob(level=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    guardrail.errors.ConfigError: invalid Knob: level = True: must be a number, not bool: ...
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Container, Iterable
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict, ValidationError

from guardrail.errors import ConfigError

__all__ = [
    "ConfigModel",
    "FiniteNumber",
    "Flag",
    "SchemaVersion",
    "StringInput",
    "WholeNumber",
    "describe_errors",
    "short_repr",
]

_MAX_WHOLE = 2**63 - 1


def _finite_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"must be a number, not {type(value).__name__}: write a plain number such as 0.5 "
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
    if abs(number) > _MAX_WHOLE:
        raise ValueError(
            f"is too large: use a whole number below 2**63 ({number.bit_length()} bits)"
        )
    return number


FiniteNumber = Annotated[float, BeforeValidator(_finite_number)]
"""A finite float field: ints and floats only (no bools, no strings, no NaN or infinity)."""
WholeNumber = Annotated[int, BeforeValidator(_whole_number)]
"""An int field: integers only (no bools, strings or floats), below 2**63 in size."""
Flag = Annotated[bool, Strict()]
"""A bool field: ``true`` or ``false`` only (no 0/1, no "yes")."""
SchemaVersion = Annotated[Literal[1], BeforeValidator(_whole_number)]
"""A file format version field: the integer 1 (not ``true``, not ``1.0``)."""


def _string_input(value: Any) -> Any:
    if not isinstance(value, str):  # an Enum would repr any value, however deep, in its error
        raise ValueError(f"must be a string, not {type(value).__name__}")
    return value


StringInput = BeforeValidator(_string_input)
"""For a ``StrEnum`` field (``Annotated[Action, StringInput]``): strings only, checked before
the enum sees the value."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


def short_repr(value: Any) -> str:
    """A bounded ``repr`` for error messages: depth, length and huge ints are cut."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        return _REPR.repr(value)
    except Exception:  # a huge int deep inside, a broken __repr__: never fail the message
        return f"<{type(value).__name__}>"


_HINTS = {
    "bool_type": ": write true or false",
    "string_type": ": write a string in quotes",
    "list_type": ": write a list [...]",
    "tuple_type": ": write a list [...]",
    "dict_type": ": write an object {...}",
    "model_type": ": write an object {...}",
    "model_attributes_type": ": write an object {...}",
}

Problem = tuple[tuple[str, ...], str, str]
"""One bad field: (location, kind: extra / missing / object / value, text)."""


def _problems(
    exc: ValidationError, fields: Iterable[str], skip: Container[str] = ()
) -> list[Problem]:
    valid = ", ".join(fields)
    found: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"] if str(p) not in skip)
        kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
        if kind == "extra_forbidden":
            listed = valid and len(loc) == 1  # a nested model has fields of its own
            found.append((loc, "extra", f"; valid fields: {valid}" if listed else ""))
        elif kind == "missing":
            found.append((loc, "missing", ""))
        elif not loc and kind not in _HINTS:  # a whole-object check: it says what to change
            found.append((loc, "object", msg))
        else:
            got = short_repr(err.get("input"))
            found.append((loc, "value", f"= {got}: {msg}{_HINTS.get(kind, '')}"))
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


def describe_errors(
    exc: ValidationError, fields: Iterable[str] = (), skip: Container[str] = ()
) -> str:
    """The problems of a pydantic error, one per bad field: where, the value given, what was
    wrong and how to fix it. ``fields`` (the model's valid fields) are listed for an unknown
    field; location parts in ``skip`` (e.g. a union's tags) are left out.

    Example:
        >>> from pydantic import BaseModel
        >>> class Rows(BaseModel):
        ...     num_examples: WholeNumber
        >>> try:
        ...     Rows.model_validate({"num_examples": True})
        ... except ValidationError as exc:
        ...     print(describe_errors(exc))  # doctest: +ELLIPSIS
        num_examples = True: must be a whole number, not bool: write ...
    """
    return "; ".join(_render(p) for p in _problems(exc, fields, skip))


class ConfigModel(BaseModel):
    """A frozen pydantic model that refuses unknown fields and raises ``ConfigError`` (a
    ``ValueError``) naming each bad field, whether it is built in Python or validated from data.

    ``model_copy(update=...)`` does not validate (pydantic); validate its result again.
    """

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
