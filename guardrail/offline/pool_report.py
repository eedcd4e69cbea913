"""The files of a pool calibration (:mod:`guardrail.offline.pool_fit`): both configs
(:func:`write_pool_calibration`) and the report beside them: ``<name>.report.json`` (every
number), ``<name>.report.md`` (the leave-one-source-out table and the clean rows flagged per
layout) and, with matplotlib, ``<name>.report.png`` (the ROC curve of each source left out,
combined probe).

The report holds no timings or paths, so the same scores give the same files.

Example:
    >>> write_pool_calibration(result, Path("configs"), "model")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from guardrail.offline.calibration import recorded_threshold
from guardrail.offline.evaluation import markdown_table, plot_roc
from guardrail.offline.pool_fit import PoolCalibration
from guardrail.offline.transfer import Measured
from guardrail.probe.config import read_model_config

__all__ = [
    "config_name",
    "report_doc",
    "report_markdown",
    "write_pool_calibration",
    "write_report",
]

KINDS = ("attention", "combined")


def _fit_summary(result: PoolCalibration, kind: str) -> dict[str, Any]:
    probe, config = result.probes[kind], result.configs[kind]
    return {
        "threshold": config.threshold,
        "cv_auroc": round(probe.fit.cv_auroc, 4),
        "c": probe.fit.c,
        "heads_kept": len(config.heads),
        "attention_layers": list(probe.attention_layers),
        "last_layers": list(probe.last_layers),
        "data_mean_layers": list(probe.data_mean_layers),
        "hidden_dims_kept": {f"{p.layer} {p.position}": len(p.dims) for p in config.hidden or []},
        "per_source_threshold": {k: recorded_threshold(v) for k, v in probe.per_source.items()},
        "data_top": {
            str(layer): {
                "top_k": column.top_k,
                "c": column.model.c,
                "layers": list(column.model.layers),
            }
            for layer, column in sorted(probe.data_top.items())
        },
    }


def _token_summary(result: PoolCalibration) -> dict[str, Any] | None:
    """The token read-out's choice: every (C, k) tried and the fit without it (CV AUROC)."""
    token = result.token
    if token is None:
        return None
    chosen = None if token.column is None else [token.column.model.c, token.column.top_k]
    return {
        "chosen": chosen,
        "layers": list(token.layers),
        "models": token.models,
        "cv_auroc": token.cv,
    }


def report_doc(
    result: PoolCalibration, skipped: Sequence[Mapping[str, str]] = ()
) -> dict[str, Any]:
    """Every number of the report, as plain data (the JSON file); ``skipped``: the rows not
    scored, with the reason (the first 50 listed, by id)."""
    listed = sorted(skipped, key=lambda row: row["id"])[:50]
    return {
        "model": result.configs["combined"].model_id,
        "rows": result.probes["combined"].rows,
        "skipped": {"count": len(skipped), "rows": [dict(row) for row in listed]},
        "recipe": asdict(result.recipe),
        "hidden_layer_cv_auroc": {str(k): v for k, v in result.layer_cv_auroc.items()},
        "fits": {kind: _fit_summary(result, kind) for kind in KINDS},
        "token_readout": _token_summary(result),
        "left_out": {
            source: {kind: left.measured for kind, left in per_kind.items()}
            for source, per_kind in result.left_out.items()
        },
        "out_of_fold": result.out_of_fold,
        "operating_points": result.operating_points,
    }


def _cell(m: Measured) -> str:
    auroc = "-" if m["auroc"] is None else f"{m['auroc']:.3f}"
    flagged = "-" if m["flagged_clean"] is None else f"{m['flagged_clean']:.1%}"
    caught = "-" if m["caught"] is None else f"{m['caught']:.0%}"
    return f"{auroc} / {flagged} / {caught}"


def _layout_cell(m: Measured | None) -> str:
    if m is None or m["flagged_clean"] is None:
        return ""
    caught = "-" if m["caught"] is None else f"{m['caught']:.0%}"
    return f"{m['flagged_clean']:.1%} / {caught} ({m['n_clean']})"


def _token_markdown(result: PoolCalibration) -> list[str]:
    token = _token_summary(result)
    if token is None:
        return []
    chosen = token["chosen"]
    verdict = (
        "not kept: no (C, k) beat the combined fit without it"
        if chosen is None
        else f"kept: C = {chosen[0]:g}, k = {chosen[1]}"
    )
    cells = {name: {"cv_auroc": value} for name, value in token["cv_auroc"].items()}
    return [
        "## Token read-out\n",
        f"A token model's k highest logits over the data tokens (the streams of layers "
        f"{token['layers']} at each token), one more column of the combined fit "
        f"({token['models']} token models: one per fold and one on all rows, of the pool and "
        f"of each source left out, per C); chosen by the pool's grouped CV "
        f"AUROC (`none`: without it): {verdict}.\n",
        markdown_table(cells, ["cv_auroc"]) + "\n",
    ]


def _share_text(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def _operating_markdown(result: PoolCalibration) -> list[str]:
    """The operating points of both kinds: pool out of fold, and each source left out."""
    cells: dict[str, dict[str, str]] = {}
    for kind in KINDS:
        for point in result.operating_points.get(kind, []):
            row: dict[str, str] = {"threshold": f"{point['threshold']:.4f}"}
            for where, spread in (("pool", point["pool"]), ("left_out", point["left_out"])):
                row[where] = (
                    "-"
                    if spread is None
                    else f"{_share_text(spread['flagged_clean_worst'], 1)} / "
                    f"{_share_text(spread['caught'], 0)} / {_share_text(spread['caught_worst'], 0)}"
                )
            cells[f"{kind}, at most {point['rate']:.0%} per source"] = row
    if not cells:
        return []
    return [
        "## Operating points\n",
        "The threshold that flags at most a share of the clean rows of every calibration "
        "source (out-of-fold focus); the config records each "
        '(`calibration.thresholds["worst-source fpr@<rate>"]`, '
        "`ModelProbeConfig.threshold_at(rate)`). `pool`: the pool fit out of fold (the "
        "threshold was set on these rows); `left_out`: each source measured at the threshold "
        "its fit without it set by the same rule. Cells: the most clean rows flagged in any "
        "source / injections caught, all / in the source where fewest are caught.\n",
        markdown_table(cells, ["threshold", "pool", "left_out"]) + "\n",
    ]


def report_markdown(result: PoolCalibration) -> str:
    """The report's tables: the fits, the operating points, each source left out (both
    kinds), and the clean rows flagged per prompt layout (each source left out, then the pool
    fit out of fold)."""
    fits = {kind: _fit_summary(result, kind) for kind in KINDS}
    columns = ["threshold", "cv_auroc", "c", "heads_kept", "last_layers", "data_mean_layers"]
    out = [
        f"# {result.configs['combined'].model_id}: calibrated on the pool\n",
        f"Attention heads of layers {fits['combined']['attention_layers']}; candidate stream "
        f"layers ranked by a hidden-only probe's grouped-CV AUROC: {result.layer_cv_auroc}. "
        f"Thresholds flag at most {result.recipe.target_fpr:g} of the clean rows of every "
        "calibration source (out-of-fold focus).\n",
        markdown_table(fits, columns) + "\n",
        *_token_markdown(result),
        *_operating_markdown(result),
        "## Leave one source out\n",
        "Each kind fitted (penalty and threshold too) without the source (BIPIA and its "
        "everyday rows leave together), measured on it. Cells: AUROC / clean rows flagged / "
        "injections caught, at the fit's own threshold.\n",
    ]
    rows = {
        source: {kind: _cell(left.measured["all"]) for kind, left in per_kind.items()}
        for source, per_kind in result.left_out.items()
    }
    out.append(markdown_table(rows, list(KINDS)) + "\n")
    for title, tables in (
        (
            "left out",
            {s: k["combined"].measured for s, k in result.left_out.items()},
        ),
        ("in the pool fit, out of fold", result.out_of_fold["combined"]),
    ):
        out.append(f"## Per prompt layout, combined probe, each source {title}\n")
        out.append("Cells: clean rows flagged / injections caught at the threshold (clean rows).\n")
        cells = {
            source: {layout: _layout_cell(by_layout.get(layout)) for layout in result.layouts}
            for source, by_layout in tables.items()
        }
        out.append(markdown_table(cells, result.layouts) + "\n")
    return "\n".join(out)


def write_report(
    result: PoolCalibration, path: Path, skipped: Sequence[Mapping[str, str]] = ()
) -> list[Path]:
    """The report at ``path`` (JSON), its tables (``.md``) and, with matplotlib, the ROC curves
    of each source left out (``.png``); the paths written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_doc(result, skipped), indent=1) + "\n")
    markdown = path.with_suffix(".md")
    markdown.write_text(report_markdown(result))
    written = [path, markdown]
    if importlib.util.find_spec("matplotlib") is not None:
        curves = {
            source: (left["combined"].labels.tolist(), (1.0 - left["combined"].focus).tolist())
            for source, left in result.left_out.items()
            if len(set(left["combined"].labels.tolist())) == 2
        }
        title = f"{result.configs['combined'].model_id}: combined probe, each source left out"
        written.append(plot_roc(curves, path.with_suffix(".png"), title))
    return written


def config_name(stem: str, kind: str) -> str:
    """The file a probe kind is written to: ``<stem>.json`` (attention, the default config)
    or ``<stem>.<kind>.json`` (a variant, as model_configs/ names them).

    Example:
        >>> config_name("SmolLM2-135M-Instruct", "combined")
        'SmolLM2-135M-Instruct.combined.json'
    """
    return f"{stem}.json" if kind == "attention" else f"{stem}.{kind}.json"


def write_pool_calibration(
    result: PoolCalibration,
    out: Path,
    stem: str,
    report: Path | None = None,
    skipped: Sequence[Mapping[str, str]] = (),
) -> list[Path]:
    """Write both configs (read back and validated) and the report (``report``, default
    ``<out>/<stem>.report.json``, with ``.md`` and ``.png`` beside it; ``skipped``: the rows
    not scored, with the reason); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, config in result.configs.items():
        path = out / config_name(stem, kind)
        path.write_text(json.dumps(config.model_dump(mode="json"), indent=1) + "\n")
        read_model_config(path)
        written.append(path)
    return written + write_report(result, report or out / f"{stem}.report.json", skipped)
