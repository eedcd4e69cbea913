"""Time of ``guardrail calibrate``'s token models, by fitter and width: one at a time, and all 84
fitted together on a device as calibration does there (``--together``).

The read-out fits 84 token models (7 scopes x 3 C x (3 folds + all rows); docs/detection.md) on
the sampled streams of the pool: about 2,900 rows x 48 tokens = 138k samples of the model's
hidden width. This script times :func:`guardrail.offline.token_readout.fit_tokens` on samples
of that size with a planted direction (what is timed is the solver, not detection): torch's
L-BFGS on a GPU where there is one, scikit-learn on the host for the widths asked
(``--host-widths``; minutes each at 2,048). ``--labels noise`` draws labels at random instead
(what a dummy-weight model's streams give: the solver runs far longer). ``--together`` also
times :func:`~guardrail.offline.token_readout.fit_tokens_jointly` on the 84 problems a
calibration of 6 sources fits (each scope: every row, or every row but one source's; 3 folds
and all its rows; 3 C), and the first ``--compare`` of them one at a time beside it, with the
objective's evaluations each way (an evaluation's time on a GPU is bounded by reading the
samples) and how far each compared model's objective ends from its own fit's.

Usage:
    python benchmarks/token_fit_speed.py --widths 576 2048 4096 --out results.json
    python benchmarks/token_fit_speed.py --widths 6144 12288 --labels noise --together --out r.json
    python benchmarks/token_fit_speed.py --streams pool.npz --rows 600 --per-row 32 --together \
        --compare 12 --device cpu --out r.json   # a calibration's own streams, labels at random
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from guardrail.offline.token_readout import TOKEN_C_GRID, fit_tokens, fit_tokens_jointly


def samples(
    rows: int, per_row: int, width: int, noise: bool = False, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Streams-like samples: per-dimension offsets and scales, labels from a planted direction
    (``noise``: each row's label at random, its samples sharing it)."""
    rng = np.random.default_rng(seed)
    n = rows * per_row
    x = rng.standard_normal((n, width), dtype=np.float32)
    x *= rng.uniform(0.2, 3.0, width).astype(np.float32)
    x += rng.normal(0, 2, width).astype(np.float32)
    margin = x[:, :64] @ rng.normal(0, 1, 64).astype(np.float32) / 16
    y = (margin + rng.logistic(0, 1, n) > 0).astype(int)
    if noise:
        y = np.repeat(rng.integers(0, 2, rows), per_row)
    return x, y


def pool_streams(
    cache: Path, layers: list[int], rows: int, per_row: int
) -> tuple[np.ndarray, np.ndarray]:
    """The sampled streams of ``layers`` side by side of a calibration's score cache: its first
    ``rows`` rows with ``per_row`` samples or more, ``per_row`` each, labelled at random by row
    (``calibration_problems`` expects that many per row)."""
    from guardrail.offline.datasets import ScoreTable

    table = ScoreTable.load(cache)
    assert table.token_offsets is not None
    counts = np.diff(table.token_offsets)
    kept = np.flatnonzero(counts >= per_row)[:rows]
    if len(kept) < rows:
        raise SystemExit(f"{cache} has {len(kept)} rows of {per_row} samples, not {rows}")
    at = (table.token_offsets[kept][:, None] + np.arange(per_row)).ravel()
    x = np.concatenate([table.tokens[layer][at] for layer in layers], axis=1)
    y = np.repeat(np.random.default_rng(0).integers(0, 2, rows), per_row)
    return x, y


def calibration_problems(rows: int, per_row: int) -> list[tuple[np.ndarray, float]]:
    """The 84 (samples, C) of a calibration on 6 sources (module doc): rows of source
    ``row % 6``, folds at random by row."""
    rng = np.random.default_rng(1)
    source, fold = np.arange(rows) % 6, rng.integers(0, 3, rows)
    scopes = [np.ones(rows, dtype=bool)] + [source != s for s in range(6)]
    problems = []
    for scope in scopes:
        for c in TOKEN_C_GRID:
            for f in (0, 1, 2, -1):
                train = scope if f == -1 else scope & (fold != f)
                problems.append((np.repeat(train, per_row), c))
    return problems


class Evaluations:
    """Counts the objective's evaluations in every L-BFGS run while entered: on a GPU, where an
    evaluation is bounded by reading the samples, the fits' time follows this count."""

    def __init__(self) -> None:
        self.count = 0
        self._step = torch.optim.LBFGS.step

    def __enter__(self) -> Evaluations:
        original, counter = self._step, self

        def step(solver: Any, closure: Callable[[], Any]) -> Any:
            def counted() -> Any:
                counter.count += 1
                return closure()

            return original(solver, counted)

        torch.optim.LBFGS.step = step  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.optim.LBFGS.step = self._step  # type: ignore[method-assign]


def objective(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    """scikit-learn's L2 logistic objective at ``model`` on its samples (standardised by their
    own mean and std), the one every fitter minimises."""
    std = x.astype(np.float64).std(0) + 1e-6
    weights = model.coef * std
    margin = (2 * y - 1) * model.logits(x)
    return float(np.logaddexp(0, -margin).mean() + weights @ weights / (2 * model.c * len(y)))


def _timed(fit: Callable[[], Any], device: str | None) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fit()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[576, 2048, 4096])
    parser.add_argument("--rows", type=int, default=2884)
    parser.add_argument("--per-row", type=int, default=48)
    parser.add_argument("--host-widths", type=int, nargs="*", default=[])
    parser.add_argument("--labels", choices=["planted", "noise"], default="planted")
    parser.add_argument("--together", action="store_true", help="time the 84 models together")
    parser.add_argument("--streams", type=Path, help="a --scores-cache with sampled streams")
    parser.add_argument("--stream-layers", type=int, nargs="+", default=[13, 15, 18])
    parser.add_argument("--compare", type=int, default=3, help="of them, timed one at a time")
    parser.add_argument("--device", help="torch's device (default: cuda where there is one)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    cases = [(w, device, c) for w in args.widths for c in TOKEN_C_GRID]
    cases += [(w, None, c) for w in args.host_widths for c in TOKEN_C_GRID if device is not None]
    if args.streams is not None:  # a calibration's own sampled streams in place of the draws
        x, y = pool_streams(args.streams, args.stream_layers, args.rows, args.per_row)
        args.widths, data = [x.shape[1]], {x.shape[1]: (x, y)}
        args.labels = f"noise, streams of layers {args.stream_layers} of {args.streams.name}"
        cases = [(x.shape[1], device, c) for c in TOKEN_C_GRID]
    else:
        widths = sorted({w for w, _, _ in cases})
        data = {w: samples(args.rows, args.per_row, w, args.labels == "noise") for w in widths}
    results = []
    for width, where, c in tqdm(cases, desc="token fits", unit="fit"):
        x, y = data[width]
        start = time.perf_counter()
        model = fit_tokens(x, y, layers=(0,), c=c, device=where)
        if where == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        results.append(
            {
                "width": width,
                "samples": len(y),
                "fitter": "scikit-learn (host)" if where is None else f"torch L-BFGS ({where})",
                "labels": args.labels,
                "C": c,
                "seconds": round(seconds, 3),
                "finite": bool(np.isfinite(model.coef).all()),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    if args.together and device is not None:
        problems = calibration_problems(args.rows, args.per_row)
        for width in tqdm(args.widths, desc="84 models together", unit="width"):
            x, y = data[width]
            with Evaluations() as joint:
                models, together = _timed(
                    partial(fit_tokens_jointly, x, y, problems, (0,), device), device
                )
            one_by_one, gaps = 0.0, []
            with Evaluations() as alone:
                for (m, c), model in zip(problems[: args.compare], models, strict=False):
                    own, seconds = _timed(partial(fit_tokens, x[m], y[m], (0,), c, device), device)
                    one_by_one += seconds
                    gaps.append(objective(model, x[m], y[m]) - objective(own, x[m], y[m]))
            results.append(
                {
                    "width": width,
                    "samples": len(y),
                    "labels": args.labels,
                    "fitter": f"torch L-BFGS ({device}), {len(problems)} models together",
                    "seconds": round(together, 3),
                    "evaluations": joint.count,
                    "one_at_a_time": {
                        "models": args.compare,
                        "seconds": round(one_by_one, 3),
                        "evaluations": alone.count,
                        "objective_together_minus_alone_max": max(gaps, default=0.0),
                    },
                    "finite": bool(all(np.isfinite(m.coef).all() for m in models)),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = torch.cuda.get_device_name() if device == "cuda" else "host CPU"
    args.out.write_text(json.dumps({"device": machine, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
