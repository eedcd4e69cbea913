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
import re
import warnings
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import (
    Field,
    model_validator,
)

from guardrail.errors import ConfigError, HeadsDoNotFitModelError, ModelConfigNotFoundError
from guardrail.probe.scoring import (
    FEATURES_PER_HEAD,
    FeatureKind,
    HeadKey,
    focus_of,
    logistic_focus,
)
from guardrail.strict import (
    ConfigModel,
    FiniteNumber,
    SchemaVersion,
    WholeNumber,
)

__all__ = [
    "DATA_POSITIONS",
    "EAGER_DEFAULT_VARIANT",
    "MAX_CONFIG_BYTES",
    "MAX_JSON_DEPTH",
    "Calibration",
    "HiddenLayerProbe",
    "HiddenPosition",
    "ModelProbeConfig",
    "load_model_config",
    "missing_rate",
    "model_id_matches",
    "packaged_model_configs",
    "parse_json_text",
    "rate_threshold",
    "read_json_file",
    "read_model_config",
    "resolve_config",
    "shipped_variants",
]

ProbeKind = Literal["mean_focus", "logistic"]
HiddenPosition = Literal["last", "data_mean", "data_top"]
"""Where a hidden-state read-out takes the residual stream: at the last prompt token, averaged
over the request's data tokens, or at the data tokens where the read-out is highest (the mean
of its ``top_k`` largest values over the data tokens)."""
DATA_POSITIONS: tuple[HiddenPosition, ...] = ("data_mean", "data_top")
"""The positions read over the data tokens: the worker keeps a per-KV-slot memo for each."""

MAX_CONFIG_BYTES = 10 * 1024 * 1024
"""Config files above this size are refused unread (the shipped ones are a few kB)."""
MAX_JSON_DEPTH = 32
"""Config JSON nested deeper than this is refused before parsing (configs nest 3 levels)."""
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


def rate_threshold(points: Mapping[float, float], rate: float) -> float | None:
    """The threshold ``points`` (``ModelProbeConfig.operating_points``) records for ``rate``,
    or None.

    Example:
        >>> rate_threshold({0.01: 0.05, 0.02: 0.14}, 0.02), rate_threshold({0.01: 0.05}, 0.03)
        (0.14, None)
    """
    for recorded, threshold in points.items():
        if math.isclose(recorded, rate, rel_tol=1e-9, abs_tol=1e-12):
            return threshold
    return None


def missing_rate(points: Mapping[float, float], rate: float) -> str:
    """Why ``rate`` has no threshold in ``points``, and what records one (an error's end)."""
    have = ", ".join(f"{r:g}" for r in points) or "none"
    return (
        f"records no threshold at rate {rate:g} (recorded: {have}); `guardrail calibrate` "
        "records the rates 0.01, 0.02 and 0.05 (and --target-fpr), and `guardrail threshold "
        "--target-fpr RATE` sets one on your own clean traffic"
    )


_SIZE_FACTS = ("num_layers", "num_heads", "num_kv_heads", "hidden_size")


class HiddenLayerProbe(ConfigModel):
    """The hidden-state part of a logistic probe for one decoder layer and position.

    The probe reads the residual stream (the decoder layer's output, before the final norm)
    ``x`` of size ``hidden_size`` at ``position``: ``"last"``, the last prompt token, or
    ``"data_mean"``, the stream averaged over the request's data tokens. It adds to the probe's
    logit ``sum(weights * (x[dims] - mean) / scale)``: a sparse linear read-out on standardised
    coordinates (only the coordinates with a non-zero weight are stored). ``"data_top"`` reads
    the same per data token and adds the mean of its ``top_k`` largest values (all of them when
    the data has fewer tokens): a read-out made for single tokens, which a short injection
    inside a long document moves where the mean would dilute it. A config's ``data_top`` parts
    on several layers are one token model over the layers' streams at each data token: per
    token their values are summed, and the term (on the last of their layers; the others' add
    0) is the mean of the ``top_k`` largest sums (:meth:`ModelProbeConfig.data_top_term`), so
    they share ``top_k``. A layer may have one read-out per position. A request without data
    tokens gets no data term (0: there is no untrusted text to read); its attention and
    last-token terms still score it.

    Example:
        >>> part = HiddenLayerProbe(layer=3, dims=[0, 7], mean=[0.1, -2.0], scale=[1.0, 4.0],
        ...                         weights=[0.5, -1.0])
        >>> part.project([1.1] + [0.0] * 6 + [2.0])
        -0.5
    """

    layer: WholeNumber = Field(ge=0)
    dims: list[WholeNumber] = Field(min_length=1)
    mean: list[FiniteNumber]
    scale: list[FiniteNumber]
    weights: list[FiniteNumber]
    position: HiddenPosition = "last"
    top_k: WholeNumber | None = Field(default=None, ge=1)  # position "data_top" only

    @model_validator(mode="after")
    def _check(self) -> HiddenLayerProbe:
        if (self.position == "data_top") != (self.top_k is not None):
            raise ValueError(
                f"hidden layer {self.layer}: top_k (how many of the data tokens' highest "
                "values to average) goes with position 'data_top', and only with it"
            )
        n = len(self.dims)
        if not len(self.mean) == len(self.scale) == len(self.weights) == n:
            raise ValueError(
                f"hidden layer {self.layer}: dims, mean, scale and weights need one value per "
                f"read coordinate: {n} dims, {len(self.mean)} means, {len(self.scale)} scales, "
                f"{len(self.weights)} weights"
            )
        if len(set(self.dims)) != n or any(d < 0 for d in self.dims):
            raise ValueError(f"hidden layer {self.layer}: dims must be distinct indices >= 0")
        if any(s <= 0 for s in self.scale):
            raise ValueError(f"hidden layer {self.layer}: every scale must be > 0")
        return self

    def project(self, stream: Sequence[float]) -> float:
        """This layer's term of the probe's logit for one residual stream (plain Python, for
        checks and tools; the worker computes the same on the device)."""
        x = np.asarray(stream, dtype=np.float64)[self.dims]
        z = (x - np.asarray(self.mean)) / np.asarray(self.scale)
        return float(np.dot(z, np.asarray(self.weights)))


class ModelProbeConfig(ConfigModel):
    """Probe settings for one model: heads, aggregation, threshold and provenance.

    ``num_layers``, ``num_heads``, ``num_kv_heads`` and ``hidden_size`` describe the model the
    config was made for (each optional, for older files); ``check_model`` compares them with the
    served model. Every number is strict and finite: a bool, a string, NaN or infinity is a
    ``ConfigError`` naming the field.
    """

    schema_version: SchemaVersion = 1
    model_id: str = Field(min_length=1)
    probe: ProbeKind = "mean_focus"
    heads: list[tuple[WholeNumber, WholeNumber]] = Field(min_length=1)
    weights: list[FiniteNumber] | None = None
    bias: FiniteNumber = 0.0
    feature: FeatureKind = "focus"
    # The hidden-state signal: logit terms read from the residual stream of these decoder
    # layers, added to the heads' (probe 'logistic' only). None: attention only.
    hidden: list[HiddenLayerProbe] | None = None
    threshold: FiniteNumber | None = Field(default=None, ge=0.0, le=1.0)
    num_layers: WholeNumber | None = Field(default=None, ge=1)
    num_heads: WholeNumber | None = Field(default=None, ge=1)
    num_kv_heads: WholeNumber | None = Field(default=None, ge=1)
    hidden_size: WholeNumber | None = Field(default=None, ge=1)
    source: str = ""
    calibration: Calibration | None = None

    @property
    def uncalibrated(self) -> str | None:
        """Why this config's scores and threshold were never measured on its model, and the
        command that fixes it; None for a calibrated config (``calibration`` recorded).

        Example:
            >>> note = ModelProbeConfig(model_id="m", heads=[(0, 0)]).uncalibrated
            >>> note.startswith("the probe config of 'm' was never calibrated")
            True
            >>> "guardrail calibrate --model" in note
            True
        """
        if self.calibration is not None:
            return None
        threshold = "no threshold" if self.threshold is None else f"threshold {self.threshold}"
        return (
            f"the probe config of {self.model_id!r} was never calibrated ({len(self.heads)} "
            f"head(s), {threshold}, none of it measured on this model): its verdicts are "
            "unreliable. Calibrate it: `guardrail calibrate --model MODEL --out DIR` (the "
            "packaged calibration pool; --data ROWS.jsonl for your own rows), then serve with "
            "the config it writes: DIR/NAME.json (attention heads: any engine mode) or "
            "DIR/NAME.combined.json (attention and hidden state: eager engines, and compiled "
            "ones on CPU and CUDA)"
        )

    @property
    def operating_points(self) -> dict[float, float]:
        """The thresholds recorded by rate, ``{rate: threshold}``, on the basis the config's
        own threshold was last set on: once re-set on the user's own clean traffic (``guardrail
        threshold``), those flagging at most ``rate`` of that traffic
        (``calibration.thresholds["traffic fpr@<rate>"]``); else those flagging at most
        ``rate`` of the clean rows of every calibration source (``"worst-source
        fpr@<rate>"``, as ``guardrail calibrate`` writes them), or of all its clean rows
        (``"fpr@<rate>"``: ``guardrail calibrate --data`` of an attention probe). Empty
        without any.

        Example:
            >>> c = ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.05,
            ...     calibration=Calibration(dataset="d", num_examples=1, sha256="0",
            ...         thresholds={"worst-source fpr@0.01": 0.05, "worst-source fpr@0.02": 0.14}))
            >>> c.operating_points
            {0.01: 0.05, 0.02: 0.14}
        """
        thresholds = self.calibration.thresholds if self.calibration is not None else {}
        for prefix in ("traffic fpr@", "worst-source fpr@", "fpr@"):
            points = {}
            for key, value in thresholds.items():
                if key.startswith(prefix):
                    try:
                        points[float(key.removeprefix(prefix))] = float(value)
                    except ValueError:
                        continue  # a key this version does not read
            if points:
                return dict(sorted(points.items()))
        return {}

    def threshold_at(self, rate: float) -> float:
        """The calibrated threshold that flags at most ``rate`` of the clean rows of every
        calibration source (:attr:`operating_points`): a looser or stricter operating point
        than the config's own ``threshold``, measured on the same rows, for
        ``PromptInjectionPolicy(threshold=config.threshold_at(0.02))``. A rate the
        calibration did not record is a ``ConfigError`` naming those it did.

        Example:
            >>> c = ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.05,
            ...     calibration=Calibration(dataset="d", num_examples=1, sha256="0",
            ...         thresholds={"worst-source fpr@0.02": 0.14}))
            >>> c.threshold_at(0.02)
            0.14
        """
        points = self.operating_points
        threshold = rate_threshold(points, rate)
        if threshold is None:
            raise ConfigError(f"the probe config of {self.model_id!r} {missing_rate(points, rate)}")
        return threshold

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
        if self.hidden is not None:
            if self.probe != "logistic":
                raise ValueError("hidden is only used by probe 'logistic'; remove it or set probe")
            reads = [(part.layer, part.position) for part in self.hidden]
            if len(set(reads)) != len(reads):
                raise ValueError(f"hidden lists a (layer, position) twice: {sorted(reads)}")
            tops = {p.top_k for p in self.hidden if p.position == "data_top"}
            if len(tops) > 1:
                raise ValueError(
                    f"the data_top read-outs are one token model over their layers and share "
                    f"top_k; got top_k {sorted(t for t in tops if t is not None)}"
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
        for part in self.hidden or []:
            if layers is not None and part.layer >= layers:
                raise ValueError(
                    f"hidden layer {part.layer} lies outside the config's {layers} layers"
                )
            if self.hidden_size is not None and max(part.dims) >= self.hidden_size:
                raise ValueError(
                    f"hidden layer {part.layer} reads coordinate {max(part.dims)}, outside the "
                    f"config's hidden_size {self.hidden_size}"
                )
        if kv is not None and heads is not None and (kv > heads or heads % kv):
            raise ValueError(
                f"num_kv_heads {kv} must divide num_heads {heads} (grouped-query attention)"
            )

    @property
    def layers(self) -> list[int]:
        """Sorted layers that hold at least one head: the layers the probe hooks."""
        return sorted({layer for layer, _ in self.heads})

    @property
    def hidden_layers(self) -> list[int]:
        """Sorted decoder layers whose residual stream the probe reads (empty: attention only)."""
        return sorted({part.layer for part in self.hidden or []})

    def hidden_layers_at(self, position: HiddenPosition) -> list[int]:
        """Sorted decoder layers the probe reads at ``position``."""
        return sorted({part.layer for part in self.hidden or [] if part.position == position})

    def data_top_term(self, streams: Mapping[int, np.ndarray]) -> float:
        """The token read-out's term (all ``data_top`` parts as one token model) from each
        of their layers' streams at the data tokens, ``{layer: [tokens, hidden_size]}`` in the
        same token order (plain Python, for checks and tools; no data tokens: 0).

        Example:
            >>> part = dict(dims=[0], mean=[0.0], scale=[1.0], weights=[1.0],
            ...             position="data_top", top_k=1)
            >>> config = ModelProbeConfig(model_id="m", probe="logistic", heads=[(0, 0)],
            ...     weights=[0.0] * 5, feature="attention_stats",
            ...     hidden=[HiddenLayerProbe(layer=1, **part), HiddenLayerProbe(layer=2, **part)])
            >>> config.data_top_term({1: np.array([[1.0], [5.0]]), 2: np.array([[3.0], [0.0]])})
            5.0
        """
        parts = [p for p in self.hidden or [] if p.position == "data_top"]
        if not parts or not all(len(streams.get(p.layer, ())) for p in parts):
            return 0.0
        values = sum(np.array([p.project(x) for x in np.asarray(streams[p.layer])]) for p in parts)
        top = np.sort(np.asarray(values))[::-1][: parts[0].top_k]
        return float(top.mean())

    def focus(
        self,
        head_stats: Mapping[HeadKey, Sequence[float]],
        hidden: Mapping[int, float] | None = None,
    ) -> float:
        """Combine per-head attention stats (``scoring.ATTENTION_STATS``) and, for a config with
        a hidden-state part, each hidden layer's logit term (``hidden``: layer -> the term, as
        ``HiddenLayerProbe.project`` computes it; a layer read at both positions has the sum of
        its two terms) into the request's focus (low = injection)."""
        stats = np.array([head_stats[h] for h in self.heads], dtype=np.float64)
        return self.focus_of_stats(stats, hidden)

    def focus_of_stats(self, stats: np.ndarray, hidden: Mapping[int, float] | None = None) -> float:
        """:meth:`focus` from the stats of the config's heads as one float64 array
        ``[len(self.heads), len(ATTENTION_STATS)]``, in ``self.heads`` order (no dict per head:
        the engine's result path)."""
        if self.probe == "logistic":
            extra = 0.0
            if self.hidden:
                if hidden is None or any(p.layer not in hidden for p in self.hidden):
                    raise ValueError(
                        f"this probe reads the hidden state of layers {self.hidden_layers}; "
                        "the request's reading lacks some"
                    )
                extra = sum(float(hidden[layer]) for layer in self.hidden_layers)
            return logistic_focus(stats, self.weights or [], self.bias + extra, self.feature)
        return sum(focus_of(stats).tolist()) / len(self.heads)

    def check_fits(self, num_layers: int, num_heads: int) -> None:
        """Raise ``HeadsDoNotFitModelError`` if a head or hidden layer lies outside a model of
        this size."""
        bad = [(lay, h) for lay, h in self.heads if lay >= num_layers or h >= num_heads]
        outside = [lay for lay in self.hidden_layers if lay >= num_layers]
        if outside:
            raise HeadsDoNotFitModelError(
                f"model config for {self.model_id!r} reads the hidden state of layers "
                f"{outside} but the loaded model has {num_layers} layers. The config was made "
                "for another model: pass the right config, or run `guardrail calibrate`."
            )
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
                "(probe_config=...), or run `guardrail calibrate --model MODEL --out DIR` "
                "to make one."
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


def _packaged_configs(variant: str | None = None) -> list[Path]:
    """The shipped config files: ``<model>.json`` (the default for a model) or, with
    ``variant``, ``<model>.<variant>.json``."""
    return [p for p in _packaged_configs_all() if _variant_of(p) == variant]


def _variant_of(path: Path) -> str | None:
    parts = path.name.removesuffix(".json").rsplit(".", 1)
    return parts[1] if len(parts) == 2 and parts[1].isidentifier() else None


def shipped_variants(model: str) -> list[str]:
    """The names of the shipped config variants for ``model`` besides its default one (e.g.
    ``["combined"]`` for the embedded SmolLM2: the attention + hidden-state probe)."""
    names = set()
    for path in _packaged_configs_all():
        variant = _variant_of(path)
        if variant is not None:
            model_id = read_model_config(path).model_id
            if model == model_id or model_id_matches(model_id, model):
                names.add(variant)
    return sorted(names)


def _packaged_configs_all() -> list[Path]:
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


def packaged_model_configs(variant: str | None = None) -> dict[str, ModelProbeConfig]:
    """Every config shipped in ``guardrail.model_configs`` (the default ones, or those of
    ``variant``), keyed by model id."""
    configs = (read_model_config(p) for p in _packaged_configs(variant))
    return {c.model_id: c for c in configs}


def load_model_config(model: str, variant: str | None = None) -> ModelProbeConfig:
    """The shipped config for a model id, or for a local model directory named like one;
    ``variant`` picks a shipped variant instead of the default (``shipped_variants``).

    A directory matches a config when its name starts with the last part of the model id
    (``.../SmolLM2-135M-Instruct-f32`` matches ``HuggingFaceTB/SmolLM2-135M-Instruct``).
    """
    configs = packaged_model_configs(variant)
    if model in configs:
        return configs[model]
    matches = [c for mid, c in configs.items() if model_id_matches(mid, model)]
    if len(matches) == 1:
        return matches[0]
    if variant is not None:
        raise ModelConfigNotFoundError(
            f"no shipped probe config variant {variant!r} for model {model!r}; its variants: "
            f"{shipped_variants(model) or 'none'}. probe_config also takes a JSON path or a "
            "ModelProbeConfig."
        )
    raise ModelConfigNotFoundError(
        f"no probe config for model {model!r}; shipped configs: {sorted(configs)}. Pass "
        "probe_config=... (a ModelProbeConfig or a JSON path; guardrail-serve: --probe-config "
        "PATH), or make one for this model with `guardrail calibrate --model MODEL --out "
        "DIR`."
    )


EAGER_DEFAULT_VARIANT = "combined"
"""The shipped variant an engine that can read the hidden state uses when no probe config is
given, for models that ship one (the embedded SmolLM2 does): attention plus hidden-state
read-outs, the better detector on every transfer measure of docs/detection.md. Engines in eager
mode read it, and so do compiled CPU and CUDA engines (their decoder layers are tapped before
vLLM compiles them: docs/compiled-hidden.md); a compiled engine on another device uses the
model's default config (attention only)."""


def resolve_config(
    model: str,
    probe_config: ModelProbeConfig | str | Path | None,
    *,
    reads_hidden: bool = False,
) -> ModelProbeConfig:
    """The probe config to use: the object given, the file given, the shipped variant named
    (a name without a path separator or ``.json``, e.g. ``"combined"``), or, with nothing
    given, the shipped default for ``model``: its ``EAGER_DEFAULT_VARIANT`` when the engine
    can read the hidden state (``reads_hidden``: eager, or compiled on CPU or CUDA) and the model
    ships that variant, else its default config.

    Example:
        >>> resolve_config("any", ModelProbeConfig(model_id="m", heads=[(0, 1)])).model_id
        'm'
    """
    if isinstance(probe_config, ModelProbeConfig):
        return probe_config
    if isinstance(probe_config, str) and _is_variant_name(probe_config):
        return load_model_config(model, probe_config)
    if probe_config is not None:
        return read_model_config(probe_config)
    if reads_hidden and EAGER_DEFAULT_VARIANT in shipped_variants(model):
        return load_model_config(model, EAGER_DEFAULT_VARIANT)
    return load_model_config(model)


def _is_variant_name(name: str) -> bool:
    return name.isidentifier() and not Path(name).exists()
