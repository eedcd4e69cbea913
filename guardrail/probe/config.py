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
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from guardrail.errors import ConfigError, HeadsDoNotFitModelError, ModelConfigNotFoundError
from guardrail.probe.scoring import (
    FEATURES_PER_HEAD,
    FeatureKind,
    HeadKey,
    head_focus,
    logistic_focus,
    mean_focus,
)

ProbeKind = Literal["mean_focus", "logistic"]


class Calibration(BaseModel):
    """How a threshold was obtained: data size and hash, so a config can be audited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str
    num_examples: int = Field(ge=0)
    sha256: str
    thresholds: dict[str, float] = Field(default_factory=dict)
    notes: str = ""
    # The longest data (tokens) among the calibration rows; a request with longer data gets a
    # ``beyond_calibration`` note on its verdict. None: not recorded (older configs).
    max_data_tokens: int | None = Field(default=None, ge=0)


class ModelProbeConfig(BaseModel):
    """Probe settings for one model: heads, aggregation, threshold and provenance."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    model_id: str = Field(min_length=1)
    probe: ProbeKind = "mean_focus"
    heads: list[tuple[int, int]] = Field(min_length=1)
    weights: list[float] | None = None
    bias: float = 0.0
    feature: FeatureKind = "focus"
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    num_layers: int | None = Field(default=None, ge=1)
    num_heads: int | None = Field(default=None, ge=1)
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
        return self

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


def _packaged_configs() -> list[Path]:
    root = resources.files("guardrail.model_configs")
    return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".json"))


def read_model_config(path: str | Path) -> ModelProbeConfig:
    """Load and validate one config file; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"model config file not found: {path}")
    try:
        return ModelProbeConfig.model_validate(json.loads(path.read_text()))
    except (ValidationError, json.JSONDecodeError) as exc:
        raise ConfigError(f"invalid model config {path}: {exc}") from exc


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
    name = Path(model).name.lower()
    matches = [c for mid, c in configs.items() if name.startswith(mid.split("/")[-1].lower())]
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
