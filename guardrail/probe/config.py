"""Probe configs: which heads to read for a model, how to combine them, and the threshold.

One JSON file per model in ``model_configs/`` (installed as ``guardrail.model_configs``), validated
by pydantic. Convention for every probe kind: the score is a *focus* in [0, 1] and low focus means
injection, so a request is suspicious when ``focus <= threshold``.

Example:
    >>> cfg = load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct")  # doctest: +SKIP
    >>> cfg.heads[:2]  # doctest: +SKIP
    [(13, 2), (14, 7)]
"""

from __future__ import annotations

import json
import math
import numbers
import re
import reprlib
import warnings
from collections.abc import Container, Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)

from guardrail.errors import ConfigError, HeadsDoNotFitModelError, ModelConfigNotFoundError
from guardrail.probe.scoring import (
    FEATURES_PER_HEAD,
    FeatureKind,
    HeadKey,
    head_focus,
    logistic_focus,
    mean_focus,
)

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_JSON_DEPTH",
    "Calibration",
    "ConfigModel",
    "FiniteNumber",
    "Flag",
    "ModelProbeConfig",
    "StringInput",
    "WholeNumber",
    "describe_errors",
    "load_model_config",
    "model_id_matches",
    "packaged_model_configs",
    "parse_json_text",
    "read_json_file",
    "read_model_config",
    "resolve_config",
    "short_repr",
]

ProbeKind = Literal["mean_focus", "logistic"]

MAX_CONFIG_BYTES = 10 * 1024 * 1024
"""Config files above this size are refused unread (the shipped ones are a few kB)."""
MAX_JSON_DEPTH = 32
"""Config JSON nested deeper than this is refused before parsing (configs nest 3 levels)."""
_MAX_WHOLE = 2**63 - 1

# -- strict, finite fields ------------------------------------------------------------------------
# Lax pydantic takes ``true`` as 1.0, ``"0.5"`` as 0.5 and NaN / infinity as floats; these types
# take numbers only (a bool is not a number, a string is never converted) and finite ones only,
# from files and from Python alike.


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
        >>> try:
        ...     Calibration.model_validate({"dataset": "d", "num_examples": True, "sha256": ""})
        ... except ConfigError as exc:
        ...     print(exc)  # doctest: +ELLIPSIS
        invalid Calibration: num_examples = True: must be a whole number, not bool: write ...
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


# -- reading JSON files safely -----------------------------------------------------------------

# A JSON string, or an unterminated one running to the end (always matches: linear time).
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (strings ignored), without parsing."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def parse_json_text(text: str, where: str) -> Any:
    """Parse JSON text, refusing what would crash or mislead the parser with ``ConfigError``:
    nesting deeper than ``MAX_JSON_DEPTH``, integers too long for Python, syntax errors."""
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(
            f"{where}: JSON nested {depth} levels deep, deeper than the {MAX_JSON_DEPTH} allowed; "
            "a config nests a few levels: is this the right file?"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer of over 4300 digits
        raise ConfigError(f"{where}: JSON that cannot be read: {exc}") from exc


def read_json_file(path: str | Path, what: str = "model config") -> Any:
    """Read a JSON file within ``MAX_CONFIG_BYTES``, as UTF-8 (a BOM is allowed), nested at most
    ``MAX_JSON_DEPTH`` deep; any problem is a ``ConfigError`` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file not found: {path}")
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{what} {path} is over {MAX_CONFIG_BYTES // (1024 * 1024)} MB, the most a config may "
            "be (the shipped ones are a few kB): is this the right file?"
        )
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 at byte {exc.start + bom} ({exc.reason}): save it as "
            "UTF-8 JSON"
        ) from exc
    return parse_json_text(text, f"{what} {path}")


# -- configs ------------------------------------------------------------------------------------


class Calibration(ConfigModel):
    """How a threshold was obtained: data size and hash, so a config can be audited."""

    dataset: str
    num_examples: WholeNumber = Field(ge=0)
    sha256: str
    thresholds: dict[str, FiniteNumber] = Field(default_factory=dict)
    notes: str = ""
    # The longest data (tokens) among the calibration rows; a request with longer data gets a
    # ``beyond_calibration`` note on its verdict. None: not recorded (older configs).
    max_data_tokens: WholeNumber | None = Field(default=None, ge=0)


_SIZE_FACTS = ("num_layers", "num_heads", "num_kv_heads", "hidden_size")


class ModelProbeConfig(ConfigModel):
    """Probe settings for one model: heads, aggregation, threshold and provenance.

    ``num_layers``, ``num_heads``, ``num_kv_heads`` and ``hidden_size`` describe the model the
    config was made for (each optional, for older files); ``check_model`` compares them with the
    served model. Every number is strict and finite: a bool, a string, NaN or infinity is a
    ``ConfigError`` naming the field.
    """

    schema_version: Annotated[Literal[1], BeforeValidator(_whole_number)] = 1
    model_id: str = Field(min_length=1)
    probe: ProbeKind = "mean_focus"
    heads: list[tuple[WholeNumber, WholeNumber]] = Field(min_length=1)
    weights: list[FiniteNumber] | None = None
    bias: FiniteNumber = 0.0
    feature: FeatureKind = "focus"
    threshold: FiniteNumber | None = Field(default=None, ge=0.0, le=1.0)
    num_layers: WholeNumber | None = Field(default=None, ge=1)
    num_heads: WholeNumber | None = Field(default=None, ge=1)
    num_kv_heads: WholeNumber | None = Field(default=None, ge=1)
    hidden_size: WholeNumber | None = Field(default=None, ge=1)
    source: str = ""
    calibration: Calibration | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelProbeConfig:
        if len(set(self.heads)) != len(self.heads):
            raise ValueError("heads contains duplicates; list each (layer, head) once")
        if any(layer < 0 or head < 0 for layer, head in self.heads):
            raise ValueError("heads must be 0-based (layer, head) pairs, got a negative index")
        if self.probe == "logistic":
            per_head = FEATURES_PER_HEAD[self.feature]
            if self.weights is None or len(self.weights) != per_head * len(self.heads):
                raise ValueError(
                    f"probe 'logistic' with feature {self.feature!r} needs {per_head} "
                    f"weight{'s' if per_head > 1 else ''} per head: {len(self.heads)} heads, "
                    f"{0 if self.weights is None else len(self.weights)} weights"
                )
        elif self.weights is not None:
            raise ValueError("weights are only used by probe 'logistic'; remove them or set probe")
        elif self.feature != "focus":
            raise ValueError(
                f"feature {self.feature!r} is only used by probe 'logistic'; remove it or set probe"
            )
        self._check_own_sizes()
        return self

    def _check_own_sizes(self) -> None:
        """The config's heads and size facts agree with each other."""
        layers, heads, kv = self.num_layers, self.num_heads, self.num_kv_heads
        outside = [
            (lay, h)
            for lay, h in self.heads
            if (layers is not None and lay >= layers) or (heads is not None and h >= heads)
        ]
        if outside:
            raise ValueError(
                f"heads {outside[:5]} lie outside the config's own model size ({layers} layers x "
                f"{heads} heads): fix the heads or num_layers / num_heads"
            )
        if kv is not None and heads is not None and (kv > heads or heads % kv):
            raise ValueError(
                f"num_kv_heads {kv} must divide num_heads {heads} (grouped-query attention)"
            )

    @property
    def layers(self) -> list[int]:
        """Sorted layers that hold at least one head: the layers the probe hooks."""
        return sorted({layer for layer, _ in self.heads})

    def focus(self, head_stats: Mapping[HeadKey, Sequence[float]]) -> float:
        """Combine per-head attention stats (``scoring.ATTENTION_STATS``) into the request's
        focus score (low = injection)."""
        if self.probe == "logistic":
            return logistic_focus(
                head_stats, self.heads, self.weights or [], self.bias, self.feature
            )
        return mean_focus(head_focus({h: head_stats[h] for h in self.heads}), self.heads)

    def check_fits(self, num_layers: int, num_heads: int) -> None:
        """Raise ``HeadsDoNotFitModelError`` if a head lies outside a model of this size."""
        bad = [(lay, h) for lay, h in self.heads if lay >= num_layers or h >= num_heads]
        if bad:
            raise HeadsDoNotFitModelError(
                f"model config for {self.model_id!r} names heads {bad[:5]} but the loaded model "
                "has "
                f"{num_layers} layers x {num_heads} heads (expected layer < {num_layers}, head < "
                f"{num_heads}). The config was made for another model: pass the right config, or "
                "run `guardrail calibrate` on this model to make one."
            )

    def check_model(self, model: str, info: Mapping[str, Any]) -> list[str]:
        """Raise ``ConfigError`` unless this config was made for the served model; return (and
        issue as ``UserWarning``) what could not be confirmed.

        ``model`` is the served model's id or path (what the engine was given); ``info`` its
        facts (``guardrail.protocol.ModelInfo``: ``num_layers``, ``num_heads``,
        ``num_kv_heads``, ``hidden_size``; a fact missing on either side is not compared).

        - A size the config records that differs from the model's is an error: the config was
          made for another model, and its heads would read unrelated attention.
        - A head outside the model is a ``HeadsDoNotFitModelError`` (``check_fits``).
        - A ``model_id`` that does not match ``model`` (equal, or a local directory whose name
          starts with the id's last part, as in ``load_model_config``) is a warning: a local copy
          or fine-tune may carry any name, and sizes are what decide whether heads make sense.

        Example:
            >>> cfg = ModelProbeConfig(model_id="org/Tiny-1B", heads=[(0, 0)], num_layers=2,
            ...                        num_heads=4, hidden_size=64)
            >>> cfg.check_model("/models/Tiny-1B-f32", {"num_layers": 2, "num_heads": 4})
            []
            >>> cfg.check_model("org/Other-8B", {"num_layers": 32, "num_heads": 4})
            Traceback (most recent call last):
            ...
            guardrail.errors.ConfigError: probe config for 'org/Tiny-1B' was made for another
            model than the served 'org/Other-8B': num_layers: config 2, served model 32. ...
        """
        recorded = {name: getattr(self, name) for name in _SIZE_FACTS}
        served = {name: _fact(info, name) for name in _SIZE_FACTS}
        differ = [
            f"{name}: config {recorded[name]}, served model {served[name]}"
            for name in _SIZE_FACTS
            if recorded[name] is not None
            and served[name] is not None
            and served[name] != recorded[name]
        ]
        if differ:
            raise ConfigError(
                f"probe config for {self.model_id!r} was made for another model than the served "
                f"{model!r}: {'; '.join(differ)}. Pass the config made for this model "
                "(probe_config=...), or run `guardrail calibrate --model MODEL --data "
                "pairs.jsonl --out DIR` to make one."
            )
        if served["num_layers"] is not None and served["num_heads"] is not None:
            self.check_fits(served["num_layers"], served["num_heads"])
        problems = []
        if not model_id_matches(self.model_id, model):
            compared = [n for n in _SIZE_FACTS if recorded[n] is not None and served[n] is not None]
            sizes = (
                f"its {', '.join(compared)} match"
                if compared
                else "it records no model sizes to compare"
            )
            problems.append(
                f"probe config model_id {self.model_id!r} does not match the served model "
                f"{model!r} ({sizes}); verdicts and metrics are labelled {self.model_id!r}. If "
                "the config was made for another model its scores mean nothing here: pass the "
                "right config, or calibrate this model with `guardrail calibrate`."
            )
        for problem in problems:
            warnings.warn(problem, UserWarning, stacklevel=2)
        return problems


def _fact(info: Mapping[str, Any], name: str) -> int | None:
    value = info.get(name)
    return None if value is None else int(value)


def model_id_matches(model_id: str, model: str) -> bool:
    """Whether the served ``model`` (an id or a path) is the one ``model_id`` names: the same id
    (any case), or a directory whose name starts with the id's last part.

    Example:
        >>> model_id_matches("HuggingFaceTB/SmolLM2-135M-Instruct", "/m/SmolLM2-135M-Instruct-f32")
        True
        >>> model_id_matches("HuggingFaceTB/SmolLM2-135M-Instruct", "meta-llama/Meta-Llama-3-8B")
        False
    """
    if model.strip().lower() == model_id.strip().lower():
        return True
    name = Path(model).name.lower()
    return bool(name) and name.startswith(model_id.split("/")[-1].lower())


def _packaged_configs() -> list[Path]:
    root = resources.files("guardrail.model_configs")
    return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".json"))


def read_model_config(path: str | Path) -> ModelProbeConfig:
    """Load and validate one config file; errors name the file and the field.

    The file must be UTF-8 JSON of at most ``MAX_CONFIG_BYTES``, nested at most
    ``MAX_JSON_DEPTH`` deep; every problem is a ``ConfigError`` (a ``ValueError``).
    """
    path = Path(path)
    data = read_json_file(path, "model config")
    try:
        return ModelProbeConfig.model_validate(data)
    except ConfigError as exc:
        detail = str(exc).removeprefix("invalid ModelProbeConfig: ")
        raise ConfigError(f"invalid model config {path}: {detail}") from exc


def packaged_model_configs() -> dict[str, ModelProbeConfig]:
    """Every config shipped in ``guardrail.model_configs``, keyed by model id."""
    configs = (read_model_config(p) for p in _packaged_configs())
    return {c.model_id: c for c in configs}


def load_model_config(model: str) -> ModelProbeConfig:
    """The shipped config for a model id, or for a local model directory named like one.

    A directory matches a config when its name starts with the last part of the model id
    (``.../SmolLM2-135M-Instruct-f32`` matches ``HuggingFaceTB/SmolLM2-135M-Instruct``).
    """
    configs = packaged_model_configs()
    if model in configs:
        return configs[model]
    matches = [c for mid, c in configs.items() if model_id_matches(mid, model)]
    if len(matches) == 1:
        return matches[0]
    raise ModelConfigNotFoundError(
        f"no probe config for model {model!r}; shipped configs: {sorted(configs)}. Pass "
        "probe_config=... (a ModelProbeConfig or a JSON path), or make one for this model with "
        "`guardrail calibrate --model MODEL --data pairs.jsonl --out DIR`."
    )


def resolve_config(
    model: str, probe_config: ModelProbeConfig | str | Path | None
) -> ModelProbeConfig:
    """The probe config to use: the object given, the file given, or the shipped one for
    ``model``.

    Example:
        >>> resolve_config("any", ModelProbeConfig(model_id="m", heads=[(0, 1)])).model_id
        'm'
    """
    if isinstance(probe_config, ModelProbeConfig):
        return probe_config
    if probe_config is not None:
        return read_model_config(probe_config)
    return load_model_config(model)
