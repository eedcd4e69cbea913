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

Needs the score cache of ``benchmarks/detection_transfer.py`` (it scores nothing itself):

    python benchmarks/detection_ceiling.py --cache /tmp/transfer_scores.npz

Writes benchmarks/results/ceiling_smollm2.json and .md (docs/detection.md quotes them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import detection_transfer as dt  # type: ignore[import-not-found]
import numpy as np

OFFSET_STATS = {"none": None, "median": 0.5, "q90": 0.9, "q99": 0.99}
HIDDEN_LAYERS = [15, 18]
"""The layers the transfer benchmark chose on the calibration pool (transfer_smollm2.json)."""


def _logit(focus: np.ndarray) -> np.ndarray:
    """The inverse of ``guardrail.offline.combined.focus_from_logit``."""
    f = np.clip(focus, 1e-12, 1 - 1e-12)
    return np.log((1 - f) / f)


def per_layout_offsets(data: Any, pool: np.ndarray, model: dict[str, Any]) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from guardrail.offline.combined import focus_from_logit, worst_source_threshold

    oof = _logit(model["fit"].oof_focus)
    labels, layouts = data.labels[pool], data.layout[pool]
    clean = labels == 0
    report: dict[str, Any] = {}
    for name, q in tqdm(OFFSET_STATS.items(), desc="per-layout offsets", unit="variant"):
        offsets = {lay: 0.0 for lay in sorted(set(data.layout.tolist()))}
        if q is not None:
            ref = float(np.quantile(oof[clean], q))
            for lay in sorted(set(layouts.tolist())):
                offsets[lay] = float(np.quantile(oof[clean & (layouts == lay)], q)) - ref
        shifted = oof - np.array([offsets[lay] for lay in layouts])
        threshold, _ = worst_source_threshold(
            focus_from_logit(shifted), labels, data.corpus[pool].tolist(), dt.TARGET_FPR
        )
        entry: dict[str, Any] = {
            "offsets": {k: round(v, 3) for k, v in offsets.items()},
            "threshold": threshold,
        }
        for corpus in dt.TEST_SOURCES:
            index = np.flatnonzero(data.corpus == corpus)
            logit = _logit(dt.focus_for(data, "combined", model, index))
            logit -= np.array([offsets.get(lay, 0.0) for lay in data.layout[index]])
            entry[corpus] = dt.measure(data.labels[index], focus_from_logit(logit), threshold)
        report[name] = entry
    return report


def handwritten_ceiling(data: Any, pool: np.ndarray) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from guardrail.offline.evaluation import auroc, tpr_at_fpr

    rows = np.flatnonzero(data.corpus == "handwritten")
    report: dict[str, Any] = {}
    for kind in tqdm(("attention", "hidden", "combined"), desc="fit on hand-written", unit="kind"):
        fit = dt.fit_kind(data, kind, rows, HIDDEN_LAYERS)["fit"]
        risk = 1.0 - fit.oof_focus
        report[f"handwritten only, {kind}"] = {
            "auroc": round(fit.cv_auroc, 4),
            "tpr@1%fpr": round(tpr_at_fpr(data.labels[rows], risk, 0.01), 4),
        }
    both = np.concatenate([pool, rows])
    fit = dt.fit_kind(data, "combined", both, HIDDEN_LAYERS)["fit"]
    mine = np.isin(both, rows)
    risk = 1.0 - fit.oof_focus[mine]
    labels = data.labels[both][mine]
    report["pool + handwritten, combined"] = {
        "auroc": round(auroc(labels, risk), 4),
        "tpr@1%fpr": round(tpr_at_fpr(labels, risk, 0.01), 4),
    }
    return report


SWEEP = (0.05, 0.02, 0.01, 0.005, 0.002)


def threshold_sweep(data: Any, model: dict[str, Any]) -> dict[str, Any]:
    everything = np.arange(len(data.labels))
    focus = {
        "default (attention)": dt.focus_for(data, "shipped", dt.shipped_model(), everything),
        "combined": dt.focus_for(data, "combined", model, everything),
    }
    report: dict[str, Any] = {}
    for name, f in focus.items():
        for threshold in SWEEP:
            entry = {}
            for corpus in dt.TEST_SOURCES + dt.CALIBRATION_SOURCES:
                index = np.flatnonzero(data.corpus == corpus)
                entry[corpus] = dt.measure(data.labels[index], f[index], threshold)
            report[f"{name} at {threshold:g}"] = entry
    return report


def markdown(report: dict[str, Any]) -> str:
    out = ["## Per-layout offsets on the combined probe's logit\n"]
    out.append("| offsets from | " + " | ".join(dt.TEST_SOURCES) + " |")
    out.append("|---|" + "---|" * len(dt.TEST_SOURCES))
    for name, entry in report["per_layout"].items():
        cells = [
            f"AUROC {entry[c]['auroc']}, flagged {entry[c]['flagged_clean']:.1%}, "
            f"caught {entry[c]['caught']:.1%}"
            for c in dt.TEST_SOURCES
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append("\n## Hand-written requests: fitted on themselves (out-of-fold)\n")
    out.append("| fit | AUROC | TPR at 1 % FPR |\n|---|---|---|")
    for name, entry in report["ceiling"].items():
        out.append(f"| {name} | {entry['auroc']} | {entry['tpr@1%fpr']} |")
    out.append("\n## Threshold sweep: clean rows flagged / injections caught, per source\n")
    sources = dt.TEST_SOURCES + dt.CALIBRATION_SOURCES
    rows = {
        name: {c: f"{entry[c]['flagged_clean']:.1%} / {entry[c]['caught']:.0%}" for c in sources}
        for name, entry in report["sweep"].items()
    }
    out.append(dt._table(rows, sources))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/transfer_scores.npz"))
    parser.add_argument("--out", type=Path, default=dt.ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if not args.cache.exists():
        parser.error(f"{args.cache}: run benchmarks/detection_transfer.py --score-only first")
    kept, table = dt.score(dt.load_rows(), args.cache, 32)
    data = dt.Data(kept, table)
    pool = np.flatnonzero(data.role == "calibration")
    model = dt.fit_kind(data, "combined", pool, HIDDEN_LAYERS)
    report = {
        "per_layout": per_layout_offsets(data, pool, model),
        "ceiling": handwritten_ceiling(data, pool),
        "sweep": threshold_sweep(data, model),
    }
    (args.out / "ceiling_smollm2.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "ceiling_smollm2.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
