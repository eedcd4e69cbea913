"""Time of one token model of ``guardrail calibrate``'s token read-out, by fitter and width.

The read-out fits 84 token models (7 scopes x 3 C x (3 folds + all rows); docs/detection.md) on
the sampled streams of the pool: about 2,900 rows x 48 tokens = 138k samples of the model's
hidden width. This script times :func:`guardrail.offline.token_readout.fit_tokens` on samples
of that size with a planted direction (what is timed is the solver, not detection): torch's
L-BFGS on a GPU where there is one, scikit-learn on the host for the widths asked
(``--host-widths``; minutes each at 2,048).

Usage:
    python benchmarks/token_fit_speed.py --widths 576 2048 4096 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from guardrail.offline.token_readout import TOKEN_C_GRID, fit_tokens


def samples(rows: int, per_row: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Streams-like samples: per-dimension offsets and scales, labels from a planted direction."""
    rng = np.random.default_rng(seed)
    n = rows * per_row
    x = rng.standard_normal((n, width), dtype=np.float32)
    x *= rng.uniform(0.2, 3.0, width).astype(np.float32)
    x += rng.normal(0, 2, width).astype(np.float32)
    margin = x[:, :64] @ rng.normal(0, 1, 64).astype(np.float32) / 16
    y = (margin + rng.logistic(0, 1, n) > 0).astype(int)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[576, 2048, 4096])
    parser.add_argument("--rows", type=int, default=2884)
    parser.add_argument("--per-row", type=int, default=48)
    parser.add_argument("--host-widths", type=int, nargs="*", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else None
    cases = [(w, device, c) for w in args.widths for c in TOKEN_C_GRID]
    cases += [(w, None, c) for w in args.host_widths for c in TOKEN_C_GRID if device is not None]
    data = {w: samples(args.rows, args.per_row, w) for w in sorted({w for w, _, _ in cases})}
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
                "C": c,
                "seconds": round(seconds, 3),
                "finite": bool(np.isfinite(model.coef).all()),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = torch.cuda.get_device_name() if device else "host CPU"
    args.out.write_text(json.dumps({"device": machine, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
