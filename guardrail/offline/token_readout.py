"""A token-level read-out over the data: a logistic model on a few layers' streams at single
data tokens, pooled per request as the mean of its ``k`` highest token logits (the ``data_top``
position of :class:`~guardrail.probe.config.HiddenLayerProbe`: one part per layer, summed per
token before the ``k`` highest are taken).

A short injection inside a long document is diluted in the data tokens' mean stream; a model
made for single tokens, pooled over the highest ones, is not (docs/detection.md, "A token-level
read-out over the data"). Calibration fits it in two passes of the serving probe:

1. the scoring pass returns, per row, the whole streams at a few sampled prompt positions
   (:func:`sample_positions`: the tokens of an injected row's attack text, or a clean row's
   data tokens, at most ``per_row`` of each), kept in the score table (``ScoreTable.tokens``);
   :func:`fit_token_model` fits a model on them (L2 logistic on standardised streams);
2. once every model calibration needs is fitted (one per cross-validation fold, one on all
   rows, the same per source left out), a second pass reads every data token's stream of each
   row and keeps its ``TOP`` highest logits per model (:func:`top_logits`), from which the
   pooled value of any ``k <= TOP`` follows (:func:`pooled`).

A pool row's pooled value comes from the model of the fold that did not see it, so the
combined fit (:func:`guardrail.offline.combined.fit_combined`, argument ``data_top``) is
cross-validated on honest values; the config serves the model fitted on every row
(:meth:`TokenColumn.parts`).

Example:
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(0, 1, (200, 8)); y = (x[:, 3] > 0.5).astype(int)
    >>> model = fit_tokens(x, y, layers=(2,), c=1.0)
    >>> tops = top_logits(x[:50], [model], 5)
    >>> tops.shape, bool(np.all(np.diff(tops[0]) <= 0))
    ((1, 5), True)
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair, ScoreTable, content_key
from guardrail.probe.config import HiddenLayerProbe

__all__ = [
    "TOKENS_PER_ROW",
    "TOKEN_C_GRID",
    "TOKEN_K_GRID",
    "TOP",
    "TokenColumn",
    "TokenModel",
    "attack_positions",
    "fit_token_model",
    "fit_token_models",
    "fit_tokens",
    "fit_tokens_jointly",
    "load_token_models",
    "models_sha256",
    "pooled",
    "problems_sha256",
    "sample_positions",
    "save_token_models",
    "token_layers",
    "top_logits",
]

TOKENS_PER_ROW = 48
"""Sampled positions per row (attack tokens of an injected row, data tokens of a clean one)."""
TOP = 20
"""The highest token logits kept per row and model: ``k`` can be chosen up to this."""
TOKEN_C_GRID: tuple[float, ...] = (0.01, 0.05, 0.2)
"""Inverse L2 strengths of the token model tried (chosen by the combined fit's CV AUROC)."""
TOKEN_K_GRID: tuple[int, ...] = (1, 3, 5, 10, 20)
"""How many of the highest token logits are averaged, tried likewise."""
JOINT_MAX_ITER = 10_000
"""L-BFGS steps at most when every model is fitted together (:func:`fit_tokens_jointly`)."""


@dataclass(frozen=True)
class TokenModel:
    """A token's injection logit ``x @ coef + intercept`` on the raw streams ``x`` of
    ``layers`` at that token, side by side (``[len(layers) * hidden_size]``, ascending layers).
    """

    layers: tuple[int, ...]
    coef: np.ndarray  # [len(layers) * hidden_size]
    intercept: float
    c: float

    def logits(self, streams: np.ndarray) -> np.ndarray:
        """``[tokens]`` logits of ``streams [tokens, len(layers) * hidden_size]``."""
        return np.asarray(streams, dtype=np.float64) @ self.coef + self.intercept

    def layer_coef(self) -> list[tuple[int, np.ndarray]]:
        """``(layer, its slice of coef)`` for each layer read."""
        width = len(self.coef) // len(self.layers)
        return [
            (layer, self.coef[j * width : (j + 1) * width]) for j, layer in enumerate(self.layers)
        ]


def token_layers(layers: Sequence[int]) -> tuple[int, ...]:
    """``layers`` as a token model reads them: distinct, ascending; refused when empty."""
    chosen = tuple(sorted({int(layer) for layer in layers}))
    if not chosen:
        raise ValueError("a token model reads at least one layer")
    return chosen


def fit_tokens(
    x: np.ndarray,
    y: np.ndarray,
    layers: Sequence[int],
    c: float,
    device: str | None = None,
) -> TokenModel:
    """An L2 logistic model on standardised streams ``x [tokens, len(layers) * hidden]`` (the
    layers' streams at each token side by side, ascending), folded back to the raw streams
    (``coef / std``, the mean into the intercept).

    ``device``: None fits with scikit-learn on the host (what the shipped configs were made
    with; 3-4 s a model at SmolLM2's 576-wide stream on 2 cores); a torch device (``"cuda"``)
    minimises the same objective with torch's L-BFGS there, for wide streams on a GPU machine:
    :func:`fit_tokens_jointly` with this one problem (one model at a time took about 1 s at
    12,288 coordinates on an H100 with a planted direction, 22 s on a dummy-weight model's
    streams; calibration fits its 84 models together: 234 s there). Should the
    device run out of memory (the samples as float64 take ``8 x tokens x hidden`` bytes there:
    4.5 GB at 138k x 4,096, next to the engine's share), the model is fitted on the host
    instead, with a warning: slower, never a failed calibration.
    """
    if device is not None:
        import torch

        try:  # the one-problem case of the joint fit
            everything = np.ones(len(y), dtype=bool)
            return fit_tokens_jointly(x, y, [(everything, c)], layers, device)[0]
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            warnings.warn(
                f"token models: {device} ran out of memory for {x.shape[0]} x {x.shape[1]} "
                "samples in float64; fitting them on the host with scikit-learn instead",
                RuntimeWarning,
                stacklevel=2,
            )
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(x, dtype=np.float64)
    mean, std = x.mean(0), x.std(0) + 1e-6
    fit = LogisticRegression(C=c, max_iter=3000).fit((x - mean) / std, y)
    coef = fit.coef_[0] / std
    return TokenModel(token_layers(layers), coef, float(fit.intercept_[0] - mean @ coef), c)


def fit_tokens_jointly(
    x: np.ndarray,
    y: np.ndarray,
    problems: Sequence[tuple[np.ndarray, float]],
    layers: Sequence[int],
    device: str,
) -> list[TokenModel]:
    """:func:`fit_tokens` of each problem ``(mask, c)`` (``mask [tokens]``: its samples of
    ``x``) on ``device``, all in one L-BFGS run: the same objective per problem (its samples
    standardised by their own mean and std, its C), summed; the problems share no parameter,
    so the sum's minimum is each one's. The samples travel and are widened once, and each step
    reads them once for every problem (one ``[tokens, width] @ [width, problems]`` product),
    where one fit per problem reads them once per step per problem: calibration's 84 token
    models at once (their fits were 22 s each at three 8B layers on an H100, one at a time).
    Refused (``torch.OutOfMemoryError``) when the device cannot hold the samples in float64."""
    import torch

    if not problems:
        return []
    masks = torch.as_tensor(np.stack([np.asarray(m, dtype=bool) for m, _ in problems], axis=1))
    # moved in the stored dtype, widened there; a copy, never the caller's array
    z = torch.from_numpy(np.ascontiguousarray(x)).to(device).to(torch.float64, copy=True)
    weights = masks.to(device=device, dtype=torch.float64)  # [tokens, problems]
    counts = weights.sum(0)
    # every problem's mean and variance, from the samples centred and scaled once
    var, mean = torch.var_mean(z, dim=0, correction=0)
    scale = var.sqrt_().add_(1e-6)
    z.sub_(mean).div_(scale)
    first = z.T @ weights / counts  # [width, problems]
    second = torch.zeros_like(first)
    for lo in range(0, z.shape[0], 8192):  # in chunks: no temporary of the samples' size
        part = z[lo : lo + 8192]
        second.addmm_(part.square().T, weights[lo : lo + 8192])
    spread = (second / counts - first.square()).clamp_(min=0).sqrt_()
    std = scale[:, None] * spread + 1e-6  # each problem's std of the raw streams
    ratio = scale[:, None] / std  # its standardised coordinates from the shared ones
    sign = torch.as_tensor(np.asarray(y), device=device).double().mul_(2).sub_(1)[:, None]
    c = torch.tensor([float(c) for _, c in problems], dtype=torch.float64, device=device)
    width = z.shape[1]
    params = torch.zeros(width + 1, len(problems), dtype=torch.float64, device=device)
    params.requires_grad_(True)
    # more steps than one model's 3,000: the shared line search makes the joint run take a few
    # times one model's (785 evaluations for 84 models where one took 215 on average, on the
    # CPU: benchmarks/results/token_fit_together_cpu_071827a.json)
    solver = torch.optim.LBFGS(
        [params], max_iter=JOINT_MAX_ITER, tolerance_grad=1e-6, line_search_fn="strong_wolfe"
    )

    def loss() -> torch.Tensor:
        solver.zero_grad()
        w, b = params[:-1], params[-1]
        v = w * ratio  # the problem's weights on the shared coordinates
        logits = z @ v - (first * v).sum(0) + b  # [tokens, problems]
        per_problem = (torch.nn.functional.softplus(-sign * logits) * weights).sum(0) / counts
        value = (per_problem + w.square().sum(0) / (2 * c * counts)).sum()
        value.backward()
        return value

    solver.step(loss)
    state = solver.state[params]
    if state["n_iter"] >= JOINT_MAX_ITER or state["func_evals"] >= JOINT_MAX_ITER * 5 // 4:
        warnings.warn(  # as scikit-learn's ConvergenceWarning: the models are used as they are
            f"token models: the joint fit of {len(problems)} models stopped after "
            f"{state['n_iter']} steps and {state['func_evals']} evaluations, before its "
            "gradient reached 1e-6",
            RuntimeWarning,
            stacklevel=2,
        )
    found = params.detach()
    raw_mean = mean[:, None] + scale[:, None] * first  # each problem's mean of the raw streams
    coef = found[:-1] / std
    intercept = found[-1] - (raw_mean * coef).sum(0)
    coef_host, intercept_host = coef.cpu().numpy(), intercept.cpu().numpy()
    chosen = token_layers(layers)
    return [
        TokenModel(chosen, coef_host[:, j].copy(), float(intercept_host[j]), float(c_j))
        for j, (_, c_j) in enumerate(problems)
    ]


def fit_token_models(
    table: ScoreTable,
    problems: Sequence[tuple[np.ndarray, float]],
    labels: np.ndarray,
    layers: Sequence[int],
    device: str | None = None,
) -> list[TokenModel]:
    """:func:`fit_token_model` of each problem ``(rows, c)``: on the host one after another;
    on ``device`` all at once (:func:`fit_tokens_jointly`), or one at a time there should it
    not hold them all, or on the host (with a warning) should it not hold even one."""
    if device is None or not problems:
        return [fit_token_model(table, rows, labels, layers, c) for rows, c in problems]
    import torch

    layers = token_layers(layers)
    union = np.unique(np.concatenate([np.asarray(rows, dtype=np.int64) for rows, _ in problems]))
    x, y, counts = _token_samples(table, union, labels, layers)
    masks = [(np.repeat(np.isin(union, rows), counts), c) for rows, c in problems]
    try:
        return fit_tokens_jointly(x, y, masks, layers, device)
    except torch.OutOfMemoryError:  # one at a time, from the memory the attempt held
        del x
        torch.cuda.empty_cache()
        return [fit_token_model(table, rows, labels, layers, c, device) for rows, c in problems]
    finally:  # the samples' memory back to the device: calibration's second pass starts an engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _token_samples(
    table: ScoreTable, rows: np.ndarray, labels: np.ndarray, layers: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sampled tokens of ``rows`` at ``layers`` side by side, each labelled with its row,
    and each row's count of them."""
    missing = [layer for layer in layers if layer not in table.tokens]
    if missing:
        raise ConfigError(f"the scores hold no sampled token streams of layers {missing}")
    samples, counts = table.token_index(rows)  # one gather, not a copy per row
    y = np.repeat(labels[rows], counts).astype(int)
    x = np.concatenate([table.tokens[layer][samples] for layer in layers], axis=1)
    return x, y, counts


def fit_token_model(
    table: ScoreTable,
    rows: np.ndarray,
    labels: np.ndarray,
    layers: Sequence[int],
    c: float,
    device: str | None = None,
) -> TokenModel:
    """:func:`fit_tokens` on the sampled tokens of ``rows`` of ``table`` at ``layers`` (each
    token labelled with its row: an injected row's samples are its attack text's tokens)."""
    layers = token_layers(layers)
    x, y, _ = _token_samples(table, rows, labels, layers)
    return fit_tokens(x, y, layers, c, device)


def top_logits(streams: np.ndarray, models: Sequence[TokenModel], top: int = TOP) -> np.ndarray:
    """``[models, top]``: each model's ``top`` highest logits over ``streams [tokens,
    len(layers) * hidden]`` (the models read the same layers), descending, NaN where there are
    fewer tokens."""
    if len({m.layers for m in models}) > 1:
        raise ValueError("top_logits scores models of the same layers only")
    out = np.full((len(models), top), np.nan)
    if len(streams) and models:
        coef = np.stack([m.coef for m in models], axis=1)  # [hidden, models]
        logits = np.asarray(streams, dtype=np.float64) @ coef + [m.intercept for m in models]
        kept = min(top, len(streams))
        out[:, :kept] = -np.sort(-logits, axis=0)[:kept].T
    return out


def pooled(tops: np.ndarray, k: int) -> np.ndarray:
    """``[rows]``: the mean of each row's ``k`` highest logits (``tops [rows, TOP]``; all it
    has when fewer)."""
    return np.nanmean(tops[:, :k], axis=1)


def models_sha256(models: Sequence[TokenModel]) -> str:
    """A digest of ``models``' numbers: a second-pass cache holds the logits of these models."""
    digest = hashlib.sha256()
    for m in models:
        digest.update(np.asarray([*m.layers, m.intercept, m.c], dtype=np.float64).tobytes())
        digest.update(np.ascontiguousarray(m.coef, dtype=np.float64).tobytes())
    return digest.hexdigest()


def problems_sha256(
    table: ScoreTable,
    problems: Sequence[tuple[np.ndarray, float]],
    labels: np.ndarray,
    layers: Sequence[int],
) -> str:
    """A digest of what the token models of ``problems`` (``(rows, C)`` each) are fitted on:
    the layers, each problem's rows and C, the rows' labels and every sampled stream of those
    layers. The same digest means the same fits."""
    digest = hashlib.sha256()
    chosen = token_layers(layers)
    digest.update(np.asarray(chosen, dtype=np.int64).tobytes())
    as_ints = np.asarray(labels, dtype=np.int64)
    for rows, c in problems:
        picked = np.asarray(rows, dtype=np.int64)
        digest.update(np.asarray([len(picked), c], dtype=np.float64).tobytes())
        digest.update(picked.tobytes())
        digest.update(as_ints[picked].tobytes())
    if table.token_offsets is not None:
        digest.update(np.ascontiguousarray(table.token_offsets, dtype=np.int64).tobytes())
    for layer in chosen:
        if layer in table.tokens:
            digest.update(np.ascontiguousarray(table.tokens[layer]).tobytes())
    return digest.hexdigest()


def save_token_models(path: Path, digest: str, models: Sequence[TokenModel]) -> None:
    """Keep ``models`` (fitted on what ``digest`` names, :func:`problems_sha256`) in ``path``,
    for :func:`load_token_models`."""
    np.savez(
        path,
        digest=np.array(digest),
        layers=np.array([m.layers for m in models], dtype=np.int64).reshape(len(models), -1),
        coef=np.stack([m.coef for m in models]) if models else np.zeros((0, 0)),
        intercept=np.array([m.intercept for m in models], dtype=np.float64),
        c=np.array([m.c for m in models], dtype=np.float64),
    )


def load_token_models(path: Path, digest: str) -> list[TokenModel] | None:
    """The models :func:`save_token_models` kept in ``path``, if they were fitted on what
    ``digest`` names; else (or without the file) None."""
    if not path.exists():
        return None
    with np.load(path) as held:
        if str(held["digest"]) != digest:
            return None
        return [
            TokenModel(tuple(int(v) for v in layers), coef.copy(), float(b), float(c))
            for layers, coef, b, c in zip(
                held["layers"], held["coef"], held["intercept"], held["c"], strict=True
            )
        ]


def attack_positions(prepared: Any, attack: str, tokenizer: Any) -> list[int]:
    """The data positions of ``prepared`` (a ``PreparedPrompt``) whose characters overlap
    ``attack`` in the rendered text: [] when the text is not found verbatim (a layout that
    escapes it) or the text does not tokenise back to the prompt's ids."""
    at = prepared.text.find(attack) if attack else -1
    if at < 0:
        return []
    encoded = tokenizer(prepared.text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != list(prepared.token_ids):
        return []
    offsets = encoded["offset_mapping"]
    return [
        t
        for a, b in prepared.data_spans
        for t in range(a, b)
        if offsets[t][1] > at and offsets[t][0] < at + len(attack)
    ]


def sample_positions(
    prepared: Any, pair: LabelledPair, tokenizer: Any, per_row: int = TOKENS_PER_ROW
) -> list[int]:
    """At most ``per_row`` prompt positions to fit the token model on, drawn with a seed from
    the row's content (so a rescored row gets the same): an injected row's attack-text tokens
    (none when its attack text is unknown or not found), a clean row's data tokens."""
    if pair.label:
        candidates = attack_positions(prepared, pair.attack or "", tokenizer)
    else:
        candidates = [t for a, b in prepared.data_spans for t in range(a, b)]
    rng = np.random.default_rng(int(content_key(pair)[:12], 16))
    picked = rng.permutation(len(candidates))[:per_row]
    return sorted(int(candidates[j]) for j in picked)


@dataclass(frozen=True)
class TokenColumn:
    """The token read-out as one column of the combined fit: ``values [rows]``, the pooled
    logit of each row (out of fold on a fit's rows), and the model and ``k`` a config serves."""

    values: np.ndarray
    model: TokenModel
    top_k: int

    def parts(self, weight: float, mean: float, std: float) -> list[HiddenLayerProbe]:
        """The ``data_top`` read-outs, one per layer of the model, that add ``weight * (pooled
        - mean) / std`` to the logit: per token the sum of ``x_layer @ (weight / std *
        coef_layer)``, offset so that the pooled sum is exact (``weight`` must be positive: the
        k highest logits are then the k highest terms)."""
        if weight <= 0:
            raise ValueError(f"a data_top read-out needs a positive weight, not {weight}")
        coef = self.model.coef
        # offset sum(scaled * m) = -(weight / std) * (intercept - mean), with m along coef
        m = -(self.model.intercept - mean) * coef / float(coef @ coef)
        width = len(coef) // len(self.model.layers)
        parts = []
        for j, (layer, part_coef) in enumerate(self.model.layer_coef()):
            scaled = weight / std * part_coef
            parts.append(
                HiddenLayerProbe(
                    layer=layer,
                    dims=list(range(len(scaled))),
                    mean=[float(v) for v in m[j * width : (j + 1) * width]],
                    scale=[1.0] * len(scaled),
                    weights=[float(v) for v in scaled],
                    position="data_top",
                    top_k=self.top_k,
                )
            )
        return parts
