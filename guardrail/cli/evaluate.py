"""``guardrail evaluate``: AUROC, AUPRC and TPR at fixed FPR of model configs, with baselines."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.cli.options import add_model_arguments, resolve_model, rows_of, scoring_settings
from guardrail.cli.output import write_json
from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair, ScoreTable
from guardrail.offline.evaluation import (
    detection_metrics,
    evaluate_detectors,
    keyword_score,
    markdown_report,
    plot_layer_sweep,
    plot_roc,
)
from guardrail.offline.row_scores import config_focus, scores_for
from guardrail.offline.served import focus_of
from guardrail.probe.config import ModelProbeConfig, read_model_config


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--config",
        nargs="+",
        required=True,
        type=Path,
        help="model config JSON files, or calibration reports (calibrate "
        "--report) to compare both probe kinds and the layer sweep",
    )
    parser.add_argument(
        "--split",
        type=Path,
        help="split file: evaluate its held-out groups only (default: every row)",
    )
    parser.add_argument(
        "--out-dir", type=Path, required=True, help="where NAME.json and NAME.md are written"
    )
    parser.add_argument("--name", default="detection", help="stem of the JSON and markdown files")
    parser.add_argument("--plot-dir", type=Path, help="where the PNGs go (default: --out-dir)")
    parser.add_argument(
        "--plot-stem", help="PNGs are roc_STEM.png, layers_STEM.png (default: --name)"
    )
    parser.add_argument("--title", default="Prompt-injection detection", help="title of the plots")


def load_detectors(
    paths: Sequence[Path],
) -> tuple[dict[str, ModelProbeConfig], list[dict[str, Any]]]:
    """Named probe configs (and layer-sweep entries) from config files or calibration reports."""
    configs: dict[str, ModelProbeConfig] = {}
    sweep: list[dict[str, Any]] = []

    def add(name: str, config: ModelProbeConfig, path: Path) -> None:
        # two files may give the same label (same stem, same layer count): name them by path
        if name in configs:
            name = f"{name} [{path}]"
        if name in configs:
            raise ConfigError(f"{path} is given twice to --config; pass each file once")
        configs[name] = config

    for path in paths:
        doc = json.loads(path.read_text())
        if "configs" not in doc:
            config = read_model_config(path)
            add(f"{config.probe} ({path.stem})", config, path)
            continue
        for kind, raw in doc["configs"].items():
            layers = len({h[0] for h in raw["heads"]})
            add(f"{kind} ({layers} layers)", ModelProbeConfig.model_validate(raw), path)
        sweep += [
            {**e, "config": ModelProbeConfig.model_validate(e["config"])}
            for e in doc.get("layer_sweep", [])
        ]
    return configs, sweep


def _measure(
    pairs: Sequence[LabelledPair],
    table: ScoreTable,
    configs: dict[str, ModelProbeConfig],
    sweep: list[dict[str, Any]],
    focus_of_config: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(detector name -> risk scores, report fields) for the probes and the baselines;
    ``focus_of_config(config)`` gives a config's focus (default: from the table)."""
    labels = [p.label for p in pairs]
    measure = focus_of_config or (lambda config: config_focus(config, table))
    focus = {name: measure(config) for name, config in configs.items()}
    detectors: dict[str, Any] = {name: 1.0 - f for name, f in focus.items()}
    detectors["keyword baseline"] = [keyword_score(p.data) for p in pairs]
    detectors["data length (tokens)"] = table.data_tokens.astype(float)
    attributes = {
        "position": [p.position for p in pairs],
        "attack_category": [p.attack_category for p in pairs],
    }
    fields = {
        "detectors": evaluate_detectors(
            labels,
            [p.task for p in pairs],
            attributes,
            detectors,
            bootstrap=True,
            groups=[p.group for p in pairs],
        ),
        "operating_points": {
            label: _operating_point(focus[name], labels, threshold)
            for name, config in configs.items()
            for label, threshold in _points(name, config)
        },
        "layer_sweep": [
            {
                "num_layers": e["num_layers"],
                "layers": e["layers"],
                "num_heads": e["num_heads"],
                "cv_auroc": e.get("cv_auroc"),
                **detection_metrics(labels, 1.0 - config_focus(e["config"], table)),
            }
            for e in sweep
        ],
    }
    return detectors, fields


def run(args: argparse.Namespace, engine: Any) -> int:
    model, _ = resolve_model(args.model)
    configs, sweep = load_detectors(args.config)
    pairs, _ = rows_of(args, args.split, held_out=True)
    every = [*configs.values(), *(e["config"] for e in sweep)]
    needed = sorted({h for c in every for h in c.heads})
    settings = scoring_settings(args, every)
    pairs, table, skipped, seconds = scores_for(pairs, model, needed, settings, engine)
    labels = [p.label for p in pairs]
    detectors, fields = _measure(
        pairs,
        table,
        configs,
        sweep,
        lambda config: focus_of(config, table, pairs, model, settings),
    )
    out, plots = args.out_dir, args.plot_dir or args.out_dir
    roc_png = plots / f"roc_{args.plot_stem or args.name}.png"
    layers_png = plots / f"layers_{args.plot_stem or args.name}.png"
    report = {
        "title": args.title,
        "model": model,
        "data": [str(p) for p in args.data],
        "split": str(args.split) if args.split else None,
        "rows": len(pairs),
        "skipped": {"count": len(skipped), "rows": skipped[:50]},
        "scoring_seconds": round(seconds, 1),
        **fields,
        "plots": [str(roc_png), *([str(layers_png)] if sweep else [])],
        "summary": [
            f"Model `{model}`; {len(pairs)} rows ({sum(labels)} injected), "
            f"{len(skipped)} skipped; data {', '.join(p.name for p in args.data)}"
            + (f", held-out groups of `{args.split.name}`." if args.split else ".")
        ],
    }
    write_json(out / f"{args.name}.json", report)
    (out / f"{args.name}.md").write_text(markdown_report(report, primary=next(iter(configs))))
    plot_roc({n: (labels, s) for n, s in detectors.items()}, roc_png, args.title)
    if sweep:
        plot_layer_sweep(fields["layer_sweep"], layers_png, "Logistic probe vs hooked layers")
    first = fields["detectors"][next(iter(configs))]["overall"]
    print(
        f"wrote {out / args.name}.{{json,md}} and plots: {next(iter(configs))} AUROC "
        f"{first['auroc']}, TPR@1%FPR {first['tpr@1%fpr']} on {len(pairs)} rows"
    )
    return 0


def _points(name: str, config: ModelProbeConfig) -> list[tuple[str, float]]:
    """The thresholds a config is measured at: its own, then each operating point it records
    (``PromptInjectionPolicy(target_fpr=...)``)."""
    own = [] if config.threshold is None else [(name, config.threshold)]
    return own + [
        (f"{name}, target_fpr {rate:g}", threshold)
        for rate, threshold in config.operating_points.items()
    ]


def _operating_point(
    focus: np.ndarray, labels: Sequence[int], threshold: float
) -> dict[str, float]:
    y = np.asarray(labels)
    flagged = focus <= threshold
    return {
        "threshold": threshold,
        "fpr": round(float(flagged[y == 0].mean()), 4),
        "tpr": round(float(flagged[y == 1].mean()), 4),
    }
