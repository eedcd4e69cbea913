"""Property-based fuzzing of everything that turns outside data into configuration: probe configs
(objects and files), policies, retry settings, steering specs and steering file metadata.

The property is the same everywhere: whatever comes in (nested dicts and lists, NaN and infinity,
bools, strings, integers of thousands of digits, random bytes, invalid UTF-8, deep nesting), the
result is either a valid object whose numbers are all finite and in range, or a ``ConfigError``;
never another exception. Bounded and derandomized so the file runs in well under a minute.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from guardrail.errors import ConfigError
from guardrail.policy import (
    DataPatternPolicy,
    PromptInjectionPolicy,
    RetrySettings,
    attempt_steering,
    load_policies,
    load_policy,
)
from guardrail.probe.config import ModelProbeConfig, read_model_config
from guardrail.probe.scoring import FEATURES_PER_HEAD
from guardrail.steering import Steering, SteeringMetadata, SteeringVector

T = TypeVar("T")

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- strategies ---------------------------------------------------------------------------------


def _deep(levels: int, leaf: Any = 0) -> Any:
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.integers(min_value=-(10**5000), max_value=10**5000),  # past float range and str limits
    st.sampled_from([0, 1, -1, 0.0, 0.5, 1.0, 2**63, math.nan, math.inf, -math.inf, 1e308]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    NUMBERS,
    st.text(max_size=12),
    st.sampled_from(["0.5", "true", "NaN", "inf", "block", "flag", "logistic", "focus"]),
)
JSON_LIKE = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)
VALUES = st.one_of(JSON_LIKE, st.integers(0, 3000).map(_deep))


def _mutated(valid: st.SearchStrategy[dict[str, Any]], names: list[str]) -> st.SearchStrategy:
    """Valid data as it is, with one field set to anything (a known or a stray key), or with
    one field dropped: valid objects and near misses in every field."""
    keys = st.one_of(st.sampled_from(names), st.text(max_size=8))
    changed = st.tuples(valid, keys, VALUES).map(lambda t: {**t[0], t[1]: t[2]})
    dropped = st.tuples(valid, st.sampled_from(names)).map(
        lambda t: {k: v for k, v in t[0].items() if k != t[1]}
    )
    return st.one_of(valid, changed, dropped)


FINITE = st.floats(-1e3, 1e3)
UNIT = st.floats(0.0, 1.0)


@st.composite
def _valid_config(draw: st.DrawFn) -> dict[str, Any]:
    layers, heads = draw(st.integers(1, 40)), draw(st.sampled_from([1, 2, 4, 8, 9, 32]))
    pairs = st.tuples(st.integers(0, layers - 1), st.integers(0, heads - 1)).map(list)
    data: dict[str, Any] = {
        "model_id": "org/model",
        "heads": draw(st.lists(pairs, min_size=1, max_size=6, unique_by=tuple)),
    }
    if draw(st.booleans()):
        feature = draw(st.sampled_from(sorted(FEATURES_PER_HEAD)))
        n = FEATURES_PER_HEAD[feature] * len(data["heads"])
        weights = draw(st.lists(FINITE, min_size=n, max_size=n))
        data.update(probe="logistic", feature=feature, weights=weights, bias=draw(FINITE))
    optional = {
        "threshold": UNIT,
        "num_layers": st.just(layers),
        "num_heads": st.just(heads),
        "num_kv_heads": st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]),
        "hidden_size": st.integers(1, 8192),
        "source": st.text(max_size=20),
        "calibration": st.fixed_dictionaries(
            {"dataset": st.just("d"), "num_examples": st.integers(0, 9), "sha256": st.just("")},
            optional={"thresholds": st.dictionaries(st.text(max_size=4), UNIT, max_size=3)},
        ),
    }
    data.update(draw(st.fixed_dictionaries({}, optional=optional)))
    return data


_RETRY_VALID = st.fixed_dictionaries(
    {},
    optional={
        "vector": st.text(min_size=1, max_size=8),
        "method": st.sampled_from(["add_vector", "adjust_rs"]),
        "coefficient": FINITE,
        "coefficient_growth": st.floats(0.1, 10.0),
        "max_attempts": st.integers(2, 4),
        "fallback": st.sampled_from(["block", "flag"]),
    },
)


@st.composite
def _valid_policy(draw: st.DrawFn) -> dict[str, Any]:
    common = {"name": st.text(min_size=1, max_size=8), "shadow": st.booleans()}
    if draw(st.booleans()):
        patterns = st.lists(
            st.sampled_from([r"<\|im_start\|>", r"\[INST\]", "a+b", "x"]), min_size=1
        )
        return {
            "kind": "data_pattern",
            "patterns": draw(patterns),
            **draw(st.fixed_dictionaries({}, optional={**common, "ignore_case": st.booleans()})),
        }
    action = draw(st.sampled_from(["allow", "flag", "block", "retry_with_steering"]))
    data = {"action": action, **draw(st.fixed_dictionaries({}, optional=common))}
    if draw(st.booleans()):
        data["kind"] = "prompt_injection"
    data.update(
        draw(
            st.one_of(
                st.fixed_dictionaries({"threshold": UNIT}),
                st.fixed_dictionaries({"threshold_offset": st.floats(-1, 1)}),
            )
        )
    )
    if action == "retry_with_steering":
        data["retry"] = draw(_RETRY_VALID)
    return data


@st.composite
def _valid_metadata(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(1, 40))
    data = {
        "name": draw(st.from_regex(r"[A-Za-z0-9._-]{1,8}", fullmatch=True)),
        "model_id": "org/model",
        "layer": draw(st.integers(0, layers - 1)),
        "hidden_size": draw(st.integers(1, 64)),
        "avg_proj": draw(FINITE),
    }
    optional = {
        "num_layers": st.just(layers),
        "coefficient": FINITE,
        "method": st.sampled_from(["add_vector", "adjust_rs"]),
        "dtype": st.sampled_from(["float32", "float16", "bfloat16"]),
        "build": st.fixed_dictionaries(
            {"dataset": st.just("rows"), "num_pairs": st.integers(0, 99)},
            optional={
                "mean_difference_norm": st.floats(0, 100),
                "layer_scores": st.dictionaries(st.integers(0, 40).map(str), FINITE, max_size=3),
            },
        ),
    }
    return {**data, **draw(st.fixed_dictionaries({}, optional=optional))}


CONFIGS = _mutated(_valid_config(), list(ModelProbeConfig.model_fields))
RETRIES = _mutated(_RETRY_VALID, list(RetrySettings.model_fields))
POLICIES = _mutated(
    _valid_policy(), sorted({*PromptInjectionPolicy.model_fields, *DataPatternPolicy.model_fields})
)
STEERINGS = _mutated(
    st.fixed_dictionaries(
        {"vector": st.text(min_size=1, max_size=8)},
        optional={"method": st.sampled_from(["add_vector", "adjust_rs"]), "coefficient": FINITE},
    ),
    list(Steering.model_fields),
)
METADATA = _mutated(_valid_metadata(), list(SteeringMetadata.model_fields))


def _outcome(build: Callable[[], T]) -> T | None:
    """The object built, or None for a ConfigError; any other exception fails the property."""
    try:
        built = build()
    except ConfigError as exc:
        assert isinstance(exc, ValueError) and 0 < len(str(exc)) < 4000  # bounded, however big
        event("ConfigError")
        return None
    event("valid")
    return built


def _finite(*values: float | None) -> bool:
    return all(
        v is None or (type(v) is float and math.isfinite(v))  # never a bool, int or string
        for v in values
    )


# -- probe configs ------------------------------------------------------------------------------


def _check_config(cfg: ModelProbeConfig) -> None:
    assert cfg.heads and all(
        type(a) is int and type(b) is int and a >= 0 and b >= 0 for a, b in cfg.heads
    )
    assert _finite(cfg.bias, cfg.threshold, *(cfg.weights or []))
    assert cfg.threshold is None or 0.0 <= cfg.threshold <= 1.0
    if cfg.calibration is not None:
        assert _finite(*cfg.calibration.thresholds.values())
    for size in (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size):
        assert size is None or (type(size) is int and size >= 1)
    if cfg.num_layers is not None and cfg.num_heads is not None:
        cfg.check_fits(cfg.num_layers, cfg.num_heads)
    assert ModelProbeConfig.model_validate(cfg.model_dump(mode="json")) == cfg


@FUZZ
@given(st.one_of(CONFIGS, VALUES))
def test_any_config_data_is_a_valid_config_or_a_config_error(data: Any) -> None:
    cfg = _outcome(lambda: ModelProbeConfig.model_validate(data))
    if cfg is not None:
        _check_config(cfg)
    if isinstance(data, dict) and all(isinstance(k, str) for k in data):
        built = _outcome(lambda: ModelProbeConfig(**data))
        assert (built is None) == (cfg is None)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "config.json"


def _json_bytes(value: Any) -> bytes:
    """JSON text of ``value``: NaN and infinity as JSON's extensions, huge integers in full."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # only while writing: reading keeps Python's limit
    try:
        return json.dumps(value).encode()
    except RecursionError:  # nested deeper than the encoder goes: the same shape by hand
        return b"[" * 5000 + b"]" * 5000
    finally:
        sys.set_int_max_str_digits(limit)


BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3", b"\xe9", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
FILE_BYTES = st.one_of(
    st.binary(max_size=300),
    CONFIGS.map(_json_bytes),
    VALUES.map(_json_bytes),
    st.tuples(CONFIGS.map(_json_bytes), st.integers(0, 400), BAD_UTF8).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
    ),
    st.tuples(CONFIGS.map(_json_bytes), st.integers(0, 400)).map(lambda t: t[0][: t[1]]),
    st.integers(0, 4000).map(lambda n: b'{"model_id": "m", "heads": ' + b"[" * n + b"]" * n + b"}"),
)


@FUZZ
@given(FILE_BYTES)
def test_any_file_is_a_valid_config_or_a_config_error_naming_it(
    config_file: Path, content: bytes
) -> None:
    config_file.write_bytes(content)
    try:
        cfg = read_model_config(config_file)
    except ConfigError as exc:
        assert str(config_file) in str(exc)
        event("ConfigError")
        return
    event("valid")
    _check_config(cfg)


# -- policies -----------------------------------------------------------------------------------


def _check_policy(policy: PromptInjectionPolicy | DataPatternPolicy) -> None:
    assert type(policy.shadow) is bool
    if isinstance(policy, PromptInjectionPolicy):
        assert _finite(policy.threshold, policy.threshold_offset)
        assert policy.threshold is None or 0.0 <= policy.threshold <= 1.0
        assert -1.0 <= policy.threshold_offset <= 1.0
        assert 0.0 <= policy.effective_threshold(0.5) <= 1.0
        retry = policy.retry
        assert _finite(retry.coefficient, retry.coefficient_growth)
        assert type(retry.max_attempts) is int and 2 <= retry.max_attempts <= 4
    else:
        assert policy.patterns and type(policy.ignore_case) is bool
    assert load_policy(policy.model_dump()) == policy
    assert load_policy(json.loads(policy.model_dump_json())) == policy


@FUZZ
@given(st.one_of(POLICIES, VALUES))
def test_any_policy_data_is_a_valid_policy_or_a_config_error(data: Any) -> None:
    policy = _outcome(lambda: load_policy(data))
    if policy is not None:
        _check_policy(policy)


@FUZZ
@given(st.one_of(st.lists(POLICIES, max_size=3), VALUES))
def test_any_policy_set_is_valid_or_a_config_error(data: Any) -> None:
    loaded = _outcome(lambda: load_policies(data, model_threshold=0.5))
    if loaded is not None:
        assert loaded and len({p.name for p in loaded}) == len(loaded)
        for policy in loaded:
            _check_policy(policy)


# -- retry settings and steering ----------------------------------------------------------------


@FUZZ
@given(RETRIES)
def test_any_retry_settings_steer_every_attempt_finitely_or_are_refused(data: Any) -> None:
    retry = _outcome(lambda: RetrySettings(**data))
    if retry is None:
        return
    assert _finite(retry.coefficient, retry.coefficient_growth)
    for attempt in range(2, retry.max_attempts + 1):
        steering = _outcome(partial(attempt_steering, retry, attempt, "v", 1.0))
        if retry.coefficient is not None:  # the file's default (1.0 here) is then ignored
            assert steering is not None and _finite(steering.coefficient)


@FUZZ
@given(st.one_of(STEERINGS, VALUES))
def test_any_steering_data_is_a_valid_steering_or_a_config_error(data: Any) -> None:
    steering = _outcome(lambda: Steering.model_validate(data))
    if steering is not None:
        assert isinstance(steering.vector, str) and _finite(steering.coefficient)


@FUZZ
@given(st.one_of(METADATA, VALUES))
def test_any_steering_metadata_is_valid_or_a_config_error(data: Any) -> None:
    meta = _outcome(lambda: SteeringMetadata.model_validate(data))
    if meta is not None:
        assert _finite(meta.coefficient, meta.avg_proj)
        assert type(meta.layer) is int and meta.layer >= 0 and meta.hidden_size >= 1
        assert SteeringMetadata.model_validate_json(meta.model_dump_json()) == meta


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _metadata_text(value: Any) -> str:
    return _json_bytes(value).decode()


@FUZZ
@given(
    st.one_of(
        METADATA.map(_metadata_text),
        VALUES.map(_metadata_text),
        st.text(max_size=200),
        st.integers(0, 3000).map(lambda n: '{"build": ' * n),
    )
)
def test_any_steering_file_metadata_is_valid_or_a_config_error_naming_the_file(
    config_file: Path, metadata: str
) -> None:
    """The file's tensor fits what valid metadata says, so only the metadata decides."""
    try:
        data = json.loads(metadata)
    except (ValueError, RecursionError):
        data = None
    size, dtype = 16, torch.float32
    if isinstance(data, dict):
        hidden = data.get("hidden_size")
        size = hidden if type(hidden) is int and 1 <= hidden <= 64 else 16
        name = data.get("dtype")
        dtype = _DTYPES.get(name, dtype) if isinstance(name, str) else dtype
    path = config_file.with_suffix(".steer.safetensors")
    direction = torch.zeros(size, dtype=dtype)
    direction[0] = 1.0
    save_file({"direction": direction}, str(path), metadata={"guardrail_steering": metadata})
    try:
        vector = SteeringVector.load(path)
    except ConfigError as exc:
        assert f"invalid steering file {path}: " in str(exc)
        event("ConfigError")
        return
    event("valid")
    meta = vector.metadata
    assert _finite(meta.coefficient, meta.avg_proj) and meta.hidden_size == size
