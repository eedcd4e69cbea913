"""The data tokens' mean stream as the serving probe reads it: does it make the combined probe
transfer, measured on the engine's own numbers?

``detection_delta.py`` measured the mean stream over the data tokens offline (Hugging Face); the
serving probe now reads it in the same pass (``HiddenLayerProbe(position="data_mean")``: each
KV slot's projection kept next to the paged KV cache, so cached documents and chunked prefill
count). This script scores every row of the transfer benchmark (``detection_transfer.py``:
six calibration sources in seven layouts, held-out BIPIA, the hand-written requests in five
layouts, AgentDojo tool outputs, which no fit or choice here ever sees) through the serving
probe of the embedded SmolLM2: all heads, the last-token stream of layers 15 and 18 (the
combined variant's layers, chosen by grouped CV on the calibration pool) and the data-mean
stream of layers 12, 15 and 18. Then it compares, with the transfer benchmark's fits,
thresholds and leave-one-source-out protocol:

- ``last``: the shipped combined variant's inputs (attention stats + last-token streams);
- ``last+data_mean``: the same plus the data-mean stream of ``DATA_MEAN_LAYERS``;
- ``data_mean``: attention stats + the data-mean stream only.

``DATA_MEAN_LAYERS`` is fixed before any result here: layer 15, the layer the offline study
read (it is also the first of the combined probe's CV-chosen layers). Layers 12 and 18 are
scored so a later choice can be made on the calibration pool without scoring again.

Parity: the served data-mean stream of layer 15 against the one Hugging Face computed for
``detection_delta.py`` on the same token ids (``--states``, when present): max abs difference.

With ``--write-config`` the ``last+data_mean`` fit on the whole pool becomes the embedded
model's ``combined`` variant (model_configs/SmolLM2-135M-Instruct.combined.json).

    python benchmarks/detection_data_mean.py --cache /tmp/dm_scores.npz \\
        --states /tmp/delta_states3.npz [--write-config]

About 30 min of scoring on 2 cores (cached in ``--cache``), then ~10 min of fits. Writes
benchmarks/results/data_mean_smollm2.{json,md} and docs/img/data_mean_<set>.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import detection_transfer as dt  # type: ignore[import-not-found]
import numpy as np

LAST_LAYERS = [15, 18]
"""Last-token layers: the combined variant's (chosen by grouped CV in transfer_smollm2.json)."""
SCORED_MEAN_LAYERS = [12, 15, 18]
DATA_MEAN_LAYERS = [15]
"""Data-mean layers the variants read (fixed up front, see the module docstring)."""
VARIANTS = {
    "last": (LAST_LAYERS, []),
    "last+data_mean": (LAST_LAYERS, DATA_MEAN_LAYERS),
    "data_mean": ([], DATA_MEAN_LAYERS),
}
KINDS = ("shipped", "combined")
SHIPPED = "last+data_mean"
"""The variant written by ``--write-config`` (the embedded model's combined variant)."""


def parity(kept: list[Any], table: Any, states_path: Path) -> dict[str, Any] | None:
    """Served data-mean (layer 15) against Hugging Face's, on the rows both hold."""
    if not states_path.exists():
        return None
    states = np.load(states_path)
    where = {str(k): i for i, k in enumerate(states["keys"])}
    rows = [(j, where[r.id]) for j, r in enumerate(kept) if r.id in where]
    served = table.data_mean[15][[j for j, _ in rows]]
    hf = states["datamean_15"][[i for _, i in rows]]
    diff = np.abs(served.astype(np.float64) - hf)
    return {
        "rows": len(rows),
        "max_abs": float(diff.max()),
        "median_abs": float(np.median(diff)),
        "stream_norm_median": float(np.median(np.linalg.norm(hf, axis=1))),
    }


def per_layout(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The combined fit's clean rows flagged / injections caught per source and prompt layout
    (test sets fitted on the pool; each calibration source left out), at the fit's threshold."""
    out: dict[str, dict[str, Any]] = {}
    sources = {c: report["full_pool"]["combined"][c] for c in dt.TEST_SOURCES}
    sources.update({f"{c} left out": v["combined"] for c, v in report["loso"].items()})
    for name, entry in sources.items():
        out[name] = {
            layout: {"flagged_clean": m["flagged_clean"], "caught": m["caught"]}
            for layout, m in entry.items()
            if layout in dt.LAYOUTS
        }
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    out = dt.summary(report, KINDS)
    out["per_layout"] = per_layout(report)
    out["threshold"] = report["full_pool"]["combined"]["threshold"]
    out["hidden_dims_kept"] = report["full_pool"]["combined"]["hidden_dims_kept"]
    out["heads_kept"] = report["full_pool"]["combined"]["heads_kept"]
    return out


def _share(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(results: dict[str, Any], check: dict[str, Any] | None) -> str:
    check_text = (
        f"served vs Hugging Face data-mean stream of layer 15 on {check['rows']} rows: max abs "
        f"{check['max_abs']:.1e}, median {check['median_abs']:.1e} (stream norm ~"
        f"{check['stream_norm_median']:.0f})"
        if check
        else "no Hugging Face states given for the parity check"
    )
    out = [
        "# The data tokens' mean stream, served: smollm2\n",
        f"Every number from the serving probe ({check_text}). Attention stats of the transfer "
        f"benchmark's heads; last-token layers {LAST_LAYERS}; data-mean layers "
        f"{DATA_MEAN_LAYERS}; same pool, fits and thresholds as transfer_smollm2.md. Cells: "
        "AUROC / share of clean rows flagged / share of injections caught at the fit's "
        "threshold. `attention-only default` is model_configs/SmolLM2-135M-Instruct.json as it "
        "ships (what compiled engines read), for reference: it is fitted on the whole pool, so "
        "its 'left out' cells are in-sample (its left-out figures are transfer_smollm2.md's "
        "`attention` kind).\n",
    ]
    sources = [s for s in results["last"]["combined"]]
    rows = {
        variant: {
            s: f"{m['auroc']:.3f} / {m['flagged_clean']:.3f} / {m['caught']:.2f}"
            for s, m in results[variant]["combined"].items()
        }
        for variant in VARIANTS
    }
    rows["attention-only default"] = {
        s: f"{m['auroc']:.3f} / {m['flagged_clean']:.3f} / {m['caught']:.2f}"
        for s, m in results["last"]["shipped"].items()
    }
    out.append("## Combined probe, by hidden input\n\n" + dt._table(rows, sources))
    tpr = {
        variant: {s: results[variant]["combined"][s]["tpr@1%fpr"] for s in dt.TEST_SOURCES}
        for variant in VARIANTS
    }
    out.append("## TPR at 1 % FPR on the held-out sets\n\n" + dt._table(tpr, dt.TEST_SOURCES))
    layouts = sorted({lay for v in results[SHIPPED]["per_layout"].values() for lay in v})
    cells = {
        source: {
            lay: f"{_share(m['flagged_clean'], 3)} / {_share(m['caught'], 2)}"
            for lay, m in by_layout.items()
        }
        for source, by_layout in results[SHIPPED]["per_layout"].items()
    }
    out.append(
        f"## Per prompt layout, {SHIPPED} (the combined variant as it ships)\n\nCells: share "
        "of clean rows flagged / share of injections caught at the fit's threshold (rows "
        "the source has no such layout for are empty).\n\n" + dt._table(cells, layouts)
    )
    kept = {
        variant: {
            "threshold": round(results[variant]["threshold"], 4),
            "heads": results[variant]["heads_kept"],
            "hidden coordinates": json.dumps(results[variant]["hidden_dims_kept"]),
        }
        for variant in VARIANTS
    }
    out.append(
        "## What each fit keeps\n\n" + dt._table(kept, ["threshold", "heads", "hidden coordinates"])
    )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/dm_scores.npz"))
    parser.add_argument("--states", type=Path, default=Path("/tmp/delta_states3.npz"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=dt.ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--write-config",
        action="store_true",
        help="write the last+data_mean fit as the embedded model's 'combined' variant",
    )
    args = parser.parse_args()
    from guardrail.offline.evaluation import plot_roc

    rows = dt.load_rows()
    kept, table = dt.score(rows, args.cache, args.batch_size, LAST_LAYERS, SCORED_MEAN_LAYERS)
    check = parity(kept, table, args.states)
    if check is not None and check["max_abs"] > 1e-2:
        raise SystemExit(f"served and Hugging Face data-mean streams differ: {check}")
    results: dict[str, Any] = {}
    curves: dict[str, dict[str, Any]] = {}
    reports: dict[str, Any] = {}
    for variant, (last, means) in VARIANTS.items():
        print(f"variant {variant}")
        report = dt.evaluate_all(kept, table, layers=last, kinds=KINDS, data_mean_layers=means)
        reports[variant] = report
        results[variant] = summary(report)
        curves[variant] = {c: report["full_pool"]["combined"][c]["_roc"] for c in dt.TEST_SOURCES}
    img = dt.ROOT / "docs" / "img"
    for corpus in dt.TEST_SOURCES:
        per_variant = {v: curves[v][corpus] for v in VARIANTS}
        plot_roc(per_variant, img / f"data_mean_{corpus}.png", f"{corpus}: combined probe, served")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "last_layers": LAST_LAYERS,
        "data_mean_layers": DATA_MEAN_LAYERS,
        "parity": check,
        "results": results,
    }
    (args.out / "data_mean_smollm2.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "data_mean_smollm2.md").write_text(markdown(results, check))
    print((args.out / "data_mean_smollm2.md").read_text())
    if args.write_config:
        data = dt.Data(kept, table)
        data.data_mean_layers = DATA_MEAN_LAYERS
        config = dt.shipped_config(reports[SHIPPED], data, "detection_data_mean.py")
        path = dt.ROOT / "model_configs" / "SmolLM2-135M-Instruct.combined.json"
        path.write_text(json.dumps(config.model_dump(mode="json"), indent=1) + "\n")
        parts = [(p.layer, p.position, len(p.dims)) for p in config.hidden or []]
        print(
            f"wrote {path}: {len(config.heads)} heads, hidden {parts}, threshold {config.threshold}"
        )


if __name__ == "__main__":
    main()
