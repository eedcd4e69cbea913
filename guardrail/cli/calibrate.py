"""``guardrail calibrate``: score labelled rows with every head and write a model config.

Without ``--data``: the packaged pool and the pool recipe (:mod:`guardrail.cli.calibrate_pool`;
on the embedded SmolLM2, ``--out model_configs`` rebuilds the shipped configs). With ``--data``
it fits the probe kind ``--probe`` asks for on those rows; its report (JSON, a per-source
markdown table and, with matplotlib, ROC curves) goes next to the config unless ``--report``
says where.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from guardrail.cli.calibrate_pool import POOL, run_pool
from guardrail.cli.options import (
    add_model_arguments,
    resolve_model,
    rows_of,
    scoring_settings,
)
from guardrail.cli.output import count, write_json
from guardrail.errors import ConfigError
from guardrail.offline.calibration import (
    CalibrationSettings,
    calibrate_probes,
    recorded_threshold,
)
from guardrail.offline.combined import (
    fit_combined,
    worst_source_threshold,
    worst_source_thresholds,
)
from guardrail.offline.datasets import LabelledPair, ScoreTable, pairs_sha256
from guardrail.offline.row_scores import scores_for
from guardrail.offline.source_report import (
    per_source_metrics,
    plot_sources,
    source_of,
    sources_markdown,
)
from guardrail.probe.config import Calibration, ModelProbeConfig, read_model_config
from guardrail.probe.scoring import HeadKey


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, data_default=POOL)
    parser.add_argument(
        "--pool-sources",
        nargs="+",
        metavar="SOURCE",
        help="without --data: calibrate on these sources of the pool only, e.g. bipia garak "
        "(names in guardrail/pool/manifest.json) (default: all of them)",
    )
    parser.add_argument(
        "--add-data",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="without --data: labelled JSONL rows calibrated on next to the pool's, each row a "
        "source named by its 'corpus' field or its file's stem, rendered like the pool's rows "
        "(e.g. clean traffic of your own as hard negatives, or attacks the pool lacks) "
        "(default: none)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write the config to")
    parser.add_argument("--model-id", help="model id in the config (default: the model's name)")
    parser.add_argument("--name", help="config file stem (default: last part of the model id)")
    parser.add_argument(
        "--exclude-split",
        type=Path,
        help="split file (guardrail split): leave its held-out groups out (default: none, "
        "every row may be used)",
    )
    parser.add_argument(
        "--twins-per-row",
        type=int,
        default=3,
        help="injected twins per benign row, when the data has no labels",
    )
    _add_fit_arguments(parser)
    parser.add_argument(
        "--report",
        type=Path,
        help="write the calibration report (JSON) here, with a per-source table (.md) and, "
        "when matplotlib is installed, ROC curves (.png) beside it (default: "
        "<out>/<name>.report.json, next to the config)",
    )


def _add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of the fit with ``--data``: probe kind, feature, threshold rule, layer
    budget, folds (without ``--data`` the pool recipe decides; ``--target-fpr``,
    ``--hidden-layers`` (candidates) and ``--data-mean-layers`` still apply)."""
    group = parser.add_argument_group(
        "the fit with --data",
        "without --data the pool recipe (guardrail.offline.transfer) fits both configs: "
        "these options are ignored, except --target-fpr; --hidden-layers names the candidate "
        "stream layers and --data-mean-layers the data-mean ones; rows over 2048 prompt "
        "tokens are skipped unless --max-prompt-tokens says otherwise",
    )
    group.add_argument(
        "--probe",
        choices=["auto", "logistic", "mean_focus", "combined"],
        default="auto",
        help="probe kind to write (auto: the best cross-validated AUROC; combined needs "
        "--hidden-layers and/or --data-mean-layers: attention features and the hidden state "
        "in one sparse model)",
    )
    group.add_argument(
        "--feature",
        choices=["logit_focus", "attention_stats", "focus"],
        default="logit_focus",
        help="what the logistic probe weighs per head (default: logit of its focus; "
        "attention_stats: five stats per head, higher AUROC on rows like the calibration rows "
        "but it transferred worse to other prompt formats, see docs/detection-attention-only.md)",
    )
    group.add_argument(
        "--threshold-rule",
        choices=["fpr", "midpoint"],
        default="fpr",
        help="where the threshold goes: fpr (the focus that flags --target-fpr of the clean "
        "rows) or midpoint (halfway between the clean and injected rows' mean focus)",
    )
    group.add_argument(
        "--target-fpr",
        type=float,
        default=0.01,
        help="share of the clean rows the fpr threshold may flag",
    )
    group.add_argument("--max-layers", type=int, default=6, help="largest layer budget swept")
    group.add_argument(
        "--layers",
        type=_layer_budget,
        default="auto",
        help="hooked-layer budget of the written config: auto (the fewest layers within 0.005 "
        "CV AUROC of the best, default), all (L1 over every layer), or a number of layers "
        "(the sweep's step with that many; the report lists them all)",
    )
    group.add_argument("--folds", type=int, default=5, help="cross-validation folds (by group)")
    group.add_argument(
        "--token-samples",
        type=int,
        default=48,
        help="without --data: the token read-out (a token model's highest logits over the "
        "data tokens) is fitted on this many sampled token streams per row, and scored in a "
        "second pass; 0 leaves it out (default 48)",
    )
    group.add_argument(
        "--token-layers",
        type=int,
        default=3,
        help="without --data: how many layers the token read-out reads at each data token: "
        "the data-mean layer, then the candidate layers ranked best (default 3)",
    )


def _layer_budget(text: str) -> int | str:
    if text in ("auto", "all"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected auto, all or a number of layers >= 1, got {text!r}")


def probe_config(
    probe: dict[str, Any],
    kind: str,
    model_id: str,
    heads: Sequence[HeadKey],
    provenance: dict[str, Any],
    hidden_size: int | None = None,
) -> ModelProbeConfig:
    """A validated ``ModelProbeConfig`` from one probe of :func:`calibrate_probes` (or of
    :func:`combined_probe`: a logistic probe with a hidden-state part)."""
    linear = kind in ("logistic", "combined")
    return ModelProbeConfig(
        model_id=model_id,
        probe="logistic" if linear else kind,  # type: ignore[arg-type]
        heads=[(int(a), int(b)) for a, b in probe["heads"]],
        weights=probe["weights"] if linear else None,
        bias=probe["bias"] if linear else 0.0,
        feature=probe.get("feature", "focus") if linear else "focus",
        hidden=probe.get("hidden") if kind == "combined" else None,
        threshold=probe["threshold"],
        num_layers=max(h[0] for h in heads) + 1,
        num_heads=max(h[1] for h in heads) + 1,
        hidden_size=hidden_size if kind == "combined" else None,
        source="guardrail calibrate: per-head attention stats"
        + (" and hidden states" if kind == "combined" else "")
        + " from the serving probe",
        calibration=Calibration(
            **provenance, thresholds=probe["thresholds"], notes=probe.get("notes", "")
        ),
    )


def _rows(args: argparse.Namespace) -> tuple[list[LabelledPair], str]:
    """The rows of ``--data`` and their description."""
    pairs, labelled = rows_of(args, args.exclude_split, False, args.twins_per_row)
    names = ", ".join(p.name for p in args.data)
    return pairs, names + ("" if labelled else " + generated twins")


def _provenance(
    args: argparse.Namespace,
    pairs: Sequence[LabelledPair],
    source: str,
    skipped: list[Any],
    table: ScoreTable,
) -> dict[str, Any]:
    """What the config records about its calibration rows: description, count, hash, length."""
    if args.exclude_split:
        source += f", minus the held-out groups of {args.exclude_split.name}"
    if args.max_groups_per_task:
        source += (
            f", at most {args.max_groups_per_task} source contexts per task (seed {args.seed})"
        )
    if args.max_prompt_tokens:
        source += f", rows over {args.max_prompt_tokens} prompt tokens skipped ({len(skipped)})"
    return {
        "dataset": source,
        "num_examples": len(pairs),
        "sha256": pairs_sha256(pairs),
        "max_data_tokens": int(table.data_tokens.max()),
    }


def calibration_settings(args: argparse.Namespace) -> CalibrationSettings:
    """The fit's settings from the command line (a layer budget widens the sweep to reach it)."""
    return CalibrationSettings(
        target_fpr=args.target_fpr,
        threshold_rule=args.threshold_rule,
        max_layers=max(args.max_layers, args.layers if isinstance(args.layers, int) else 0),
        budget=args.layers,
        probe=args.probe,
        feature=args.feature,
        folds=args.folds,
        seed=args.seed,
    )


def _fit(
    settings: CalibrationSettings, pairs: Sequence[LabelledPair], table: ScoreTable
) -> dict[str, Any]:
    labels = np.array([p.label for p in pairs])
    if len(np.unique(labels)) < 2:
        raise ConfigError(
            f"calibration needs clean and injected rows; got {len(pairs)} scored "
            f"rows with labels {sorted(set(labels.tolist()))}"
        )
    with tqdm(total=settings.max_layers, desc="layer sweep", unit="layer") as bar:
        return calibrate_probes(
            table.values,
            labels,
            table.heads,
            [p.group for p in pairs],
            settings,
            progress=lambda done, total: bar.update(1),
        )


def combined_probe(
    settings: CalibrationSettings,
    pairs: Sequence[LabelledPair],
    table: ScoreTable,
    layers: Sequence[int],
) -> dict[str, Any]:
    """The combined probe over every head of ``layers`` (the attention probe's layer budget)
    and the table's hidden layers; its threshold flags at most ``settings.target_fpr`` of the
    clean rows of every corpus (``corpus`` field, else task), on out-of-fold focus."""
    cols = [j for j, (layer, _) in enumerate(table.heads) if layer in set(layers)]
    labels = np.array([p.label for p in pairs])
    fit = fit_combined(
        table.values[:, cols],
        [table.heads[j] for j in cols],
        table.hidden,
        labels,
        [p.group for p in pairs],
        feature=settings.feature,
        folds=settings.folds,
        seed=settings.seed,
        data_mean=table.data_mean,
    )
    sources = [str(p.extra.get("corpus") or p.task) for p in pairs]
    fpr = settings.target_fpr
    threshold, per_source = worst_source_threshold(fit.oof_focus, labels, sources, fpr)
    values = {f"worst-source fpr@{fpr:g}": recorded_threshold(threshold)}
    values.update({f"{name} fpr@{fpr:g}": recorded_threshold(v) for name, v in per_source.items()})
    points = worst_source_thresholds(fit.oof_focus, labels, sources)  # the operating points
    values.update({f"worst-source fpr@{r:g}": recorded_threshold(t) for r, t in points.items()})
    return {
        **fit.probe_fields(),
        "threshold": recorded_threshold(threshold),
        "thresholds": values,
        "cv_auroc": fit.cv_auroc,
        "oof_focus": fit.oof_focus,
        "notes": f"L1 logistic on {fit.feature} of the heads of layers {sorted(layers)} and the "
        f"hidden state of layers {sorted(table.hidden)} (last prompt token) and "
        f"{sorted(table.data_mean)} (data tokens' mean), C={fit.c}; threshold flags at most "
        f"{fpr:g} of every corpus' clean rows (out-of-fold focus)",
    }


def _fit_probes(
    settings: CalibrationSettings, pairs: Sequence[LabelledPair], table: ScoreTable
) -> dict[str, Any]:
    """:func:`calibrate_probes`' result, with the combined probe added when the table holds
    hidden states (and chosen when asked for, or when ``auto`` finds it best)."""
    if settings.probe == "combined" and not (table.hidden or table.data_mean):
        raise ConfigError(
            "--probe combined needs --hidden-layers and/or --data-mean-layers (the layers it reads)"
        )
    result = _fit(settings, pairs, table)
    if table.hidden or table.data_mean:
        layers = sorted({layer for layer, _ in result["probes"]["logistic"]["heads"]})
        result["probes"]["combined"] = combined_probe(settings, pairs, table, layers)
        if settings.probe in ("auto", "combined"):
            best = max(result["probes"], key=lambda k: result["probes"][k]["cv_auroc"])
            result["chosen"] = "combined" if settings.probe == "combined" else best
    return result


def _report(
    result: dict[str, Any],
    configs: dict[str, ModelProbeConfig],
    model_id: str,
    table: ScoreTable,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """The calibration report's fields about the fit: the layer sweep (each step's config
    too), the chosen kind, each kind's CV AUROC and config."""
    sweep = [
        {
            "num_layers": len(e["layers"]),
            "num_heads": len(e["probe"]["heads"]),
            **{k: v for k, v in e.items() if k != "probe"},
            "config": probe_config(
                e["probe"], "logistic", model_id, table.heads, provenance
            ).model_dump(mode="json"),
        }
        for e in result["layer_sweep"]
    ]
    return {
        **{k: result[k] for k in ("chosen", "selection_n", "n_search")},
        "layer_sweep": sweep,
        "cv_auroc": {k: p["cv_auroc"] for k, p in result["probes"].items()},
        "configs": {k: c.model_dump(mode="json") for k, c in configs.items()},
    }


def _write_report(
    path: Path,
    doc: dict[str, Any],
    pairs: Sequence[LabelledPair],
    kind: str,
    probe: dict[str, Any],
    config: ModelProbeConfig,
) -> list[Path]:
    """The report JSON at ``path`` with the chosen probe's (``kind``'s) per-source table
    (out-of-fold focus), the table as markdown beside it and, with matplotlib, the sources'
    ROC curves."""
    focus = np.asarray(probe["oof_focus"], dtype=float)
    threshold = float(config.threshold if config.threshold is not None else 0.0)
    table = per_source_metrics(pairs, focus, threshold)
    write_json(path, {**doc, "per_source": table})
    written = [path, path.with_suffix(".md")]
    title = (
        f"{config.model_id}: {kind} probe, out-of-fold focus per source (threshold {threshold:.4f})"
    )
    written[1].write_text(sources_markdown(table, title))
    if importlib.util.find_spec("matplotlib") is not None:
        written.append(plot_sources(pairs, focus, path.with_suffix(".png"), title))
    return written


def run(args: argparse.Namespace, engine: Any) -> int:
    if not args.data:
        return run_pool(args, engine)
    if args.pool_sources or args.add_data:
        flag = "--pool-sources picks sources of" if args.pool_sources else "--add-data adds rows to"
        raise ConfigError(f"{flag} the packaged pool: drop --data")
    model, default_id = resolve_model(args.model)
    model_id = args.model_id or default_id
    pairs, source = _rows(args)
    pairs, table, skipped, score_seconds = scores_for(
        pairs, model, "all", scoring_settings(args), engine
    )
    started = time.perf_counter()
    result = _fit_probes(calibration_settings(args), pairs, table)
    fit_seconds = time.perf_counter() - started
    provenance = _provenance(args, pairs, source, skipped, table)
    streams = [*table.hidden.values(), *table.data_mean.values()]
    hidden_size = next((v.shape[1] for v in streams), None)
    configs = {
        kind: probe_config(probe, kind, model_id, table.heads, provenance, hidden_size)
        for kind, probe in result["probes"].items()
    }
    stem = args.name or model_id.split("/")[-1]
    path = args.out / f"{stem}.json"
    write_json(path, configs[result["chosen"]].model_dump(mode="json"))
    read_model_config(path)  # what was written loads and validates
    reports = _write_report(
        args.report or args.out / f"{stem}.report.json",
        {
            "model": model_id,
            "data": source,
            "rows": len(pairs),
            "tasks": count(p.task for p in pairs),
            "sources": count(source_of(p) for p in pairs),
            "skipped": {"count": len(skipped), "rows": skipped[:50]},
            "scoring_seconds": round(score_seconds, 1),
            "fit_seconds": round(fit_seconds, 1),
            **_report(result, configs, model_id, table, provenance),
        },
        pairs,
        result["chosen"],
        result["probes"][result["chosen"]],
        configs[result["chosen"]],
    )
    chosen = configs[result["chosen"]]
    print(
        f"wrote {path}: probe {chosen.probe}, {len(chosen.heads)} heads on layers "
        f"{chosen.layers}, threshold {chosen.threshold:.4f}; {len(pairs)} rows "
        f"({len(skipped)} skipped), scoring {score_seconds:.0f} s, fitting {fit_seconds:.0f} s"
    )
    print(f"report: {', '.join(map(str, reports))}")
    return 0
