"""Where the detector's limit is: two diagnostics on the scores detection_transfer.py cached.

1. Per-layout calibration. The layout a request's data sits in (a user message, a tool message,
   the system message of a RAG template, ...) is known when it is served, so a per-layout offset
   on the combined probe's logit could make one threshold mean the same thing in every layout.
   Offsets are set on the calibration pool's out-of-fold logits of clean rows (each layout's
   median, 90th or 99th percentile moved onto the pool's), the threshold is set again on the
   shifted pool (the worst source's 1 %-FPR threshold), and the held-out sets are measured as in
   the transfer table.
2. A ceiling for the hand-written requests: the same probe kinds fitted on those rows themselves
   (grouped 3-fold cross-validation, a request's layouts kept in one fold), and the combined
   probe fitted on the calibration pool plus those rows (their out-of-fold scores). If even that
   stays far from the goal, the features the model computes do not separate these requests, and
   more calibration data like them would not either. AgentDojo is reserved as a held-out set and
   is never fitted on, not even for this.
3. Is there a threshold that holds on clean traffic of every source? Both shipped configs (the
   attention-only default and the combined variant fitted on the whole pool) at a sweep of
   thresholds: the share of clean rows flagged and of injections caught, per source (the
   calibration sources in sample, the test sets held out).

Reads the score cache of ``benchmarks/detection_transfer.py`` (scoring what it lacks); the
fits, thresholds and measures are the library's (:mod:`guardrail.offline.transfer`):

    python benchmarks/detection_ceiling.py --cache scores.npz [--bipia-dir ../shared/data/bipia]

Writes benchmarks/results/ceiling_smollm2.json and .md (docs/detection.md quotes them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.embedded import EMBEDDED_MODEL_ID, model_or_embedded
from guardrail.offline.combined import focus_from_logit, worst_source_threshold
from guardrail.offline.evaluation import auroc, markdown_table, tpr_at_fpr
from guardrail.offline.transfer import (
    ProbeFit,
    ScoredPool,
    TransferRecipe,
    fit_probe,
    measure,
    probe_focus,
    recipe_for,
)
from guardrail.offline.transfer_eval import score_rows, test_sets, transfer_rows
from guardrail.probe.config import load_model_config

ROOT = Path(__file__).resolve().parents[1]
OFFSET_STATS = {"none": None, "median": 0.5, "q90": 0.9, "q99": 0.99}
HIDDEN_LAYERS = (15, 18)
"""The layers the transfer benchmark chose on the calibration pool (transfer_smollm2.json)."""
SWEEP = (0.05, 0.02, 0.01, 0.005, 0.002)


def _logit(focus: np.ndarray) -> np.ndarray:
    """The inverse of ``guardrail.offline.combined.focus_from_logit``."""
    f = np.clip(focus, 1e-12, 1 - 1e-12)
    return np.log((1 - f) / f)


def _tests(pool: ScoredPool) -> list[str]:
    return sorted(set(pool.corpus[pool.role == "test"].tolist()))


def per_layout_offsets(pool: ScoredPool, model: ProbeFit, fpr: float) -> dict[str, Any]:
    from tqdm.auto import tqdm

    index = pool.calibration
    oof = _logit(model.fit.oof_focus)
    labels, layouts = pool.labels[index], pool.layout[index]
    clean = labels == 0
    report: dict[str, Any] = {}
    for name, q in tqdm(OFFSET_STATS.items(), desc="per-layout offsets", unit="variant"):
        offsets = {lay: 0.0 for lay in sorted(set(pool.layout.tolist()))}
        if q is not None:
            ref = float(np.quantile(oof[clean], q))
            for lay in sorted(set(layouts.tolist())):
                offsets[lay] = float(np.quantile(oof[clean & (layouts == lay)], q)) - ref
        shifted = oof - np.array([offsets[lay] for lay in layouts])
        threshold, _ = worst_source_threshold(
            focus_from_logit(shifted), labels, pool.corpus[index].tolist(), fpr
        )
        entry: dict[str, Any] = {
            "offsets": {k: round(v, 3) for k, v in offsets.items()},
            "threshold": threshold,
        }
        for corpus in _tests(pool):
            rows = np.flatnonzero(pool.corpus == corpus)
            logit = _logit(probe_focus(pool, model, rows))
            logit -= np.array([offsets.get(lay, 0.0) for lay in pool.layout[rows]])
            entry[corpus] = measure(pool.labels[rows], focus_from_logit(logit), threshold)
        report[name] = entry
    return report


def handwritten_ceiling(
    pool: ScoredPool, recipe: TransferRecipe, attention: tuple[int, ...]
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    rows = np.flatnonzero(pool.corpus == "handwritten")
    report: dict[str, Any] = {}
    for kind in tqdm(("attention", "hidden", "combined"), desc="fit on hand-written", unit="kind"):
        fit = fit_probe(pool, kind, rows, recipe, attention, HIDDEN_LAYERS).fit
        risk = 1.0 - fit.oof_focus
        report[f"handwritten only, {kind}"] = {
            "auroc": round(fit.cv_auroc, 4),
            "tpr_at_1pct_fpr": round(tpr_at_fpr(pool.labels[rows], risk, 0.01), 4),
        }
    both = np.concatenate([pool.calibration, rows])
    fit = fit_probe(pool, "combined", both, recipe, attention, HIDDEN_LAYERS).fit
    mine = np.isin(both, rows)
    risk = 1.0 - fit.oof_focus[mine]
    labels = pool.labels[both][mine]
    report["pool + handwritten, combined"] = {
        "auroc": round(auroc(labels, risk), 4),
        "tpr_at_1pct_fpr": round(tpr_at_fpr(labels, risk, 0.01), 4),
    }
    return report


def threshold_sweep(pool: ScoredPool, model: ProbeFit) -> dict[str, Any]:
    from guardrail.offline.row_scores import config_focus

    everything = np.arange(len(pool.labels))
    focus = {
        "default (attention)": config_focus(load_model_config(EMBEDDED_MODEL_ID), pool.table),
        "combined": probe_focus(pool, model, everything),
    }
    sources = sorted(set(pool.corpus.tolist()))
    report: dict[str, Any] = {}
    for name, f in focus.items():
        for threshold in SWEEP:
            report[f"{name} at {threshold:g}"] = {
                corpus: measure(pool.labels[i], f[i], threshold)
                for corpus in sources
                for i in [np.flatnonzero(pool.corpus == corpus)]
            }
    return report


def markdown(report: dict[str, Any]) -> str:
    tests = sorted(
        {k for entry in report["per_layout"].values() for k in entry} - {"offsets", "threshold"}
    )
    rows = {
        name: {
            c: f"AUROC {entry[c]['auroc']}, flagged {entry[c]['flagged_clean']:.1%}, "
            f"caught {entry[c]['caught']:.1%}"
            for c in tests
        }
        for name, entry in report["per_layout"].items()
    }
    out = ["## Per-layout offsets on the combined probe's logit\n", markdown_table(rows, tests)]
    out.append("\n## Hand-written requests: fitted on themselves (out-of-fold)\n")
    out.append(markdown_table(report["ceiling"], ["auroc", "tpr_at_1pct_fpr"]))
    out.append("\n## Threshold sweep: clean rows flagged / injections caught, per source\n")
    sources = sorted({c for entry in report["sweep"].values() for c in entry})
    sweep = {
        name: {c: f"{entry[c]['flagged_clean']:.1%} / {entry[c]['caught']:.0%}" for c in sources}
        for name, entry in report["sweep"].items()
    }
    out.append(markdown_table(sweep, sources))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="score cache (.npz)")
    parser.add_argument("--bipia-dir", type=Path, help="BIPIA's files: adds the held-out split")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    recipe = recipe_for(EMBEDDED_MODEL_ID, 30)
    split = ROOT / "docs" / "bipia_heldout_split.json"
    rows = transfer_rows(test_sets(ROOT / "benchmarks" / "data", split, args.bipia_dir))
    pool = score_rows(rows, model_or_embedded(None), recipe.hidden_candidates, args.cache)
    attention = recipe.attention_layers or ()
    model = fit_probe(pool, "combined", pool.calibration, recipe, attention, HIDDEN_LAYERS)
    report = {
        "per_layout": per_layout_offsets(pool, model, recipe.target_fpr),
        "ceiling": handwritten_ceiling(pool, recipe, attention),
        "sweep": threshold_sweep(pool, model),
    }
    (args.out / "ceiling_smollm2.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "ceiling_smollm2.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
