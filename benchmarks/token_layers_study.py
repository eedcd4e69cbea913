"""Which streams a token model should read: one layer or several, linear or not.

The token read-out (docs/detection.md, "A token-level read-out over the data") is a logistic
model on the residual stream at single data tokens. This study asks, on the pool's sampled
tokens alone (the streams ``guardrail calibrate --scores-cache`` keeps: an injected row's attack
tokens, a clean row's data tokens, up to 48 per row, of every candidate layer), how well a token
model tells attack tokens from clean data tokens when it reads one layer, several layers side by
side, or a small MLP on the same inputs. Every model is scored out of fold (5 folds by the
pool's groups, as calibration's folds); two figures per variant:

- token AUROC: the sampled tokens' logits against their labels;
- row AUROC (max): each row's highest sampled-token logit against the row's label. A proxy
  only (an injected row's samples are its attack tokens, a clean row's a sample of its data),
  for ranking the variants; the read-out calibration serves is measured by ``guardrail
  calibrate`` and the served test sets.

No config is written. The linear variants are what the serving probe can read (per layer a
dot product, summed per token: ``data_top`` parts on several layers); the MLP is the ceiling
of a nonlinear token model on the same streams.

    python benchmarks/token_layers_study.py --cache pool.npz

Writes benchmarks/results/token_layers_smollm2.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier
from tqdm import tqdm

from guardrail.offline.calibration import group_folds
from guardrail.offline.datasets import ScoreTable
from guardrail.offline.evaluation import auroc, markdown_table
from guardrail.offline.pool import load_pool
from guardrail.offline.transfer import ScoredPool

ROOT = Path(__file__).resolve().parents[1]
C = 0.01  # the token models' L2 strength the shipped read-out chose
VARIANTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "linear, layer 15": ("linear", (15,)),
    "linear, layers 13+15": ("linear", (13, 15)),
    "linear, layers 15+18": ("linear", (15, 18)),
    "linear, layers 15+18+21": ("linear", (15, 18, 21)),
    "linear, layers 13+15+18": ("linear", (13, 15, 18)),
    "linear, all seven candidates": ("linear", (6, 10, 13, 15, 18, 21, 25)),
    "MLP (64), layer 15": ("mlp", (15,)),
    "MLP (64), layers 15+18+21": ("mlp", (15, 18, 21)),
}


def _model(kind: str) -> Any:
    if kind == "linear":
        return LogisticRegression(C=C, max_iter=3000)
    return MLPClassifier((64,), alpha=1e-2, max_iter=60, early_stopping=True, random_state=0)


def study(pool: ScoredPool, folds: int = 5) -> dict[str, dict[str, float]]:
    """Every variant's out-of-fold token and row AUROC on the pool's sampled tokens."""
    rows = np.arange(len(pool.rows))
    fold_of = group_folds(pool.groups(rows), folds, 0)
    samples, counts = pool.table.token_index(rows)
    row_of = np.repeat(rows, counts)
    y = np.repeat(pool.labels, counts).astype(int)
    out: dict[str, dict[str, float]] = {}
    for name, (kind, layers) in tqdm(VARIANTS.items(), desc="variants", unit="variant"):
        started = time.perf_counter()
        x = np.concatenate(
            [np.asarray(pool.table.tokens[layer][samples], dtype=np.float32) for layer in layers],
            axis=1,
        )
        logit = np.empty(len(y))
        for fold in np.unique(fold_of):
            test = fold_of[row_of] == fold
            mean, std = x[~test].mean(0), x[~test].std(0) + 1e-6
            model = _model(kind).fit((x[~test] - mean) / std, y[~test])
            z = (x[test] - mean) / std
            if kind == "linear":
                logit[test] = model.decision_function(z)
            else:
                logit[test] = model.predict_proba(z)[:, 1]
        top = np.full(len(rows), -np.inf)
        np.maximum.at(top, row_of, logit)
        sampled = np.isfinite(top)  # rows with no sample (attack text not found) left out
        out[name] = {
            "token_auroc": round(auroc(y, logit), 4),
            "row_auroc_max": round(auroc(pool.labels[sampled], top[sampled]), 4),
            "width": int(x.shape[1]),
            "seconds": round(time.perf_counter() - started, 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="guardrail calibrate's cache")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    pairs = load_pool()
    table = ScoreTable.load(args.cache)
    index, rows = table.rows(pairs)
    pool = ScoredPool([pairs[i] for i in index], table.select(rows))
    results = study(pool)
    samples = int(pool.table.token_index(np.arange(len(pool.rows)))[1].sum())
    doc = {"rows": len(pool.rows), "sampled_tokens": samples, "c": C, "variants": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "token_layers_smollm2.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = (
        f"# Token models on the pool's sampled tokens ({len(pool.rows)} rows, {samples} tokens;"
        f" 5 group folds, out of fold)\n\n"
        + markdown_table(results, ["token_auroc", "row_auroc_max", "width", "seconds"])
        + "\n"
    )
    (args.out / "token_layers_smollm2.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
