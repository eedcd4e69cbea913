"""The shipped combined config on short tool outputs: does its threshold hold, what it catches.

Issue 29 asks that the shipped threshold hold on clean traffic unlike the calibration pool
(short tool outputs, one-line API results, JSON from tools) and catch more at that rate. This
script serves the config on the test set ``benchmarks/make_tool_outputs.py`` writes (196 clean
tool outputs of 14 tools, 392 injected twins; never calibrated on) and reports:

- at the shipped threshold: the share of clean rows flagged and of injections caught, overall,
  per tool and per attack;
- a sweep of thresholds (flagged / caught);
- **a threshold from your own traffic**, as ``guardrail threshold`` sets it
  (:func:`guardrail.offline.calibration.retarget_threshold`, 1 % of the clean rows): set on the
  clean rows of half of the groups, measured on the other half, both ways (two folds, every
  tool in both halves: a user's shadow traffic is the kind of traffic they serve later);
- a PNG of the focus of clean and injected rows with both thresholds.

The focus is served (the config reads the data tokens' token read-out, which no score table
holds), by an eager engine on the embedded SmolLM2 (CPU: about 2 minutes for 588 rows);
``--focus-cache`` keeps it between runs.

Usage:
    python benchmarks/tool_outputs_check.py [--config FILE] [--out FILE] [--png FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.embedded import embedded_model_path
from guardrail.offline.calibration import retarget_threshold
from guardrail.offline.datasets import load_pairs, pairs_sha256
from guardrail.offline.row_scores import ScoringSettings
from guardrail.offline.served import served_focus
from guardrail.offline.transfer import measure
from guardrail.probe.config import read_model_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "heldout" / "short_tool_outputs.jsonl"
CONFIG = ROOT / "model_configs" / "SmolLM2-135M-Instruct.combined.json"
OUT = ROOT / "benchmarks" / "results" / "tool_outputs_smollm2.json"
PNG = ROOT / "docs" / "img" / "tool_outputs_focus.png"
SWEEP = (0.022, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
OWN_FPR = 0.01


def shown(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def rates(focus: np.ndarray, labels: np.ndarray, threshold: float) -> dict[str, Any]:
    """The library's :func:`~guardrail.offline.transfer.measure` at ``threshold`` (AUROC, clean
    rows flagged, injections caught), with the threshold."""
    return {"threshold": round(float(threshold), 6), **measure(labels, focus, threshold)}


def own_traffic(
    config: Any, focus: np.ndarray, labels: np.ndarray, groups: list[str]
) -> list[dict[str, Any]]:
    """Two folds by group: the threshold ``guardrail threshold`` sets on one half's clean rows,
    measured on the other half."""
    ordered = sorted(set(groups))
    half = {g: i % 2 for i, g in enumerate(ordered)}  # groups are tool-major: every tool in both
    fold = np.array([half[g] for g in groups])
    results = []
    for held in (0, 1):
        fit, test = fold != held, fold == held
        clean = focus[fit & (labels == 0)]
        new, _ = retarget_threshold(config, clean, OWN_FPR, "fold", "-")
        assert new.threshold is not None
        results.append(
            {"clean_rows_used": int(clean.size), **rates(focus[test], labels[test], new.threshold)}
        )
    return results


def plot(focus: np.ndarray, labels: np.ndarray, shipped: float, own: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = np.logspace(-5, 0, 51)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    clipped = np.clip(focus, 1e-5, 1.0)
    ax.hist(clipped[labels == 0], bins, alpha=0.6, label=f"clean ({(labels == 0).sum()})")
    ax.hist(clipped[labels == 1], bins, alpha=0.6, label=f"injected ({(labels == 1).sum()})")
    ax.axvline(shipped, color="k", ls="--", label=f"shipped threshold {shipped:.3f}")
    own_label = f"own-traffic threshold (1 % of clean rows, mean of 2 folds) {own:.2f}"
    ax.axvline(own, color="C3", ls=":", label=own_label)
    ax.set_xscale("log")
    ax.set_xlabel("focus (low: the model attends to the data, not the instruction)")
    ax.set_ylabel("rows")
    ax.set_title("SmolLM2-135M combined config on short tool outputs (never calibrated on)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--png", type=Path, default=PNG)
    parser.add_argument("--focus-cache", type=Path, help="JSON of served focus by row id")
    args = parser.parse_args()
    pairs, _ = load_pairs(args.data)
    config = read_model_config(args.config)
    assert config.threshold is not None
    ids = [p.id for p in pairs]
    cached = None
    if args.focus_cache is not None and args.focus_cache.exists():
        cached = json.loads(args.focus_cache.read_text())
    if cached is not None and cached["ids"] == ids and cached["config"] == str(args.config):
        focus = np.array(cached["focus"])
    else:
        focus = served_focus(pairs, str(embedded_model_path()), config, ScoringSettings())
        if args.focus_cache is not None:
            record = {"config": str(args.config), "ids": ids, "focus": focus.tolist()}
            args.focus_cache.write_text(json.dumps(record))
    labels = np.array([p.label for p in pairs])
    tools = np.array([p.task for p in pairs])
    attacks = np.array([p.attack or "" for p in pairs])
    folds = own_traffic(config, focus, labels, [p.group for p in pairs])
    result = {
        "config": str(
            args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
        ),
        "data": str(args.data.relative_to(ROOT) if args.data.is_relative_to(ROOT) else args.data),
        "rows_sha256": pairs_sha256(pairs),
        "rows": len(pairs),
        "clean": int((labels == 0).sum()),
        "clean_focus_min": round(float(focus[labels == 0].min()), 4),
        "shipped": rates(focus, labels, config.threshold),
        "per_tool": {
            tool: rates(focus[m], labels[m], config.threshold)
            for tool in sorted(set(tools.tolist()))
            for m in [tools == tool]
        },
        "per_attack": {
            attack: {
                "rows": int(m.sum()),
                "median_focus": round(float(np.median(focus[m])), 4),
                **rates(focus[m | (labels == 0)], labels[m | (labels == 0)], config.threshold),
            }
            for attack in sorted({p.attack for p in pairs if p.attack})
            for m in [attacks == attack]
        },
        "sweep": [rates(focus, labels, t) for t in SWEEP],
        "own_traffic_threshold": folds,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    own = float(np.mean([f["threshold"] for f in folds]))
    plot(focus, labels, config.threshold, own, args.png)
    print(json.dumps({k: result[k] for k in ("shipped", "own_traffic_threshold")}))
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
