"""``guardrail threshold``: re-set a config's threshold on clean requests of your own traffic:
rows scored here (``--data``), or the score histogram a running guard exposes
(``--from-metrics``, :mod:`guardrail.offline.shadow`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from guardrail.cli.options import add_model_arguments, resolve_model, scoring_settings
from guardrail.cli.output import write_json
from guardrail.errors import ConfigError
from guardrail.offline.calibration import retarget_threshold
from guardrail.offline.datasets import load_pairs, pairs_sha256, sample_groups
from guardrail.offline.row_scores import scores_for
from guardrail.offline.served import focus_of
from guardrail.offline.shadow import (
    MIN_SAMPLES_PER_FLAG,
    read_scrape,
    score_histogram,
    threshold_from_histogram,
)
from guardrail.probe.config import ModelProbeConfig, read_model_config, resolve_config


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, data_default="none: --from-metrics instead")
    parser.add_argument(
        "--from-metrics",
        metavar="SCRAPE",
        help="instead of --data: a running guard's metrics URL (http://HOST:PORT/metrics) or a "
        "saved scrape; the threshold is read off its guardrail_probe_score histogram (trusted, "
        "clean traffic only, e.g. a guard in shadow mode; see docs/detection.md) (default: none, "
        "--data is scored)",
    )
    parser.add_argument(
        "--since",
        metavar="SCRAPE",
        help="with --from-metrics: an earlier scrape of the same guard; only the scores "
        "recorded between the two count (default: none, every score since the guard started)",
    )
    parser.add_argument(
        "--model-name",
        help="with --from-metrics: the model_name label of the guard's series (default: the "
        "config's model id)",
    )
    parser.add_argument(
        "--config",
        required=True,
        help="model config to re-threshold: a JSON file, or the name of a config variant shipped "
        "for --model (e.g. combined, what eager engines of the embedded SmolLM2 read)",
    )
    parser.add_argument("--out", type=Path, required=True, help="config file to write")
    parser.add_argument(
        "--target-fpr",
        type=float,
        default=0.01,
        help="share of these clean rows the new threshold may flag (default 0.01)",
    )


def run(args: argparse.Namespace, engine: Any) -> int:
    if not 0.0 <= args.target_fpr < 1.0:
        raise ConfigError(f"--target-fpr must be in [0, 1), got {args.target_fpr}")
    if (args.data is None) == (args.from_metrics is None):
        raise ConfigError(
            "give the clean traffic one way: --data ROWS.jsonl (scored here) or --from-metrics "
            "URL_OR_FILE (a guard's score histogram)"
        )
    if args.from_metrics is not None:  # no model needed for a config file: nothing is scored
        if Path(args.config).is_file():
            return _from_metrics(args, read_model_config(args.config))
        return _from_metrics(args, resolve_config(resolve_model(args.model)[0], args.config))
    model, _ = resolve_model(args.model)
    config = resolve_config(model, args.config)
    pairs, _ = load_pairs(args.data)  # unlabelled rows load as label 0: all clean
    if args.max_groups_per_task:
        pairs = sample_groups(pairs, args.max_groups_per_task, args.seed)
    clean = [p for p in pairs if p.label == 0]
    if not clean:
        raise ConfigError(
            f"no clean rows in {', '.join(str(p) for p in args.data)}: the threshold is set on "
            "clean requests (label 0, or rows without labels)"
        )
    settings = scoring_settings(args, [config])
    clean, table, skipped, _ = scores_for(clean, model, config.heads, settings, engine)
    source = ", ".join(p.name for p in args.data)
    new, info = retarget_threshold(
        config,
        focus_of(config, table, clean, model, settings),
        args.target_fpr,
        source,
        pairs_sha256(clean),
        max_data_tokens=int(table.data_tokens.max()),
    )
    write_json(args.out, new.model_dump(mode="json"))
    read_model_config(args.out)  # what was written loads and validates
    print(
        f"wrote {args.out}: threshold {info['threshold']:.4f} (was {config.threshold}) on "
        f"{len(clean)} clean rows ({len(skipped)} skipped); the old threshold flagged "
        f"{info['flagged_before']:.1%} of them, the new one flags {info['flagged_after']:.1%}"
    )
    return 0


def _from_metrics(args: argparse.Namespace, config: ModelProbeConfig) -> int:
    """The threshold read off a guard's score histogram (``--from-metrics``)."""
    name = args.model_name or config.model_id
    histogram = score_histogram(read_scrape(args.from_metrics), name)
    source = f"a scrape of {args.from_metrics}"
    if args.since is not None:
        histogram = histogram.minus(score_histogram(read_scrape(args.since), name))
        source = f"scrapes of {args.since} and then {args.from_metrics}"
    new, info = threshold_from_histogram(config, histogram, args.target_fpr, source)
    write_json(args.out, new.model_dump(mode="json"))
    read_model_config(args.out)  # what was written loads and validates
    enough = MIN_SAMPLES_PER_FLAG / args.target_fpr
    print(
        f"wrote {args.out}: threshold {info['threshold']:g} (was {config.threshold}) from "
        f"{info['samples']:.0f} scored requests of {name!r}: it flags {info['flagged_after']:.2%}"
        f" of them; the next bucket edge, {info['next_edge']:g}, would flag "
        f"{info['flagged_next']:.2%}"
        + (
            f". Only {info['samples']:.0f} scores: at least {enough:.0f} are needed to read "
            f"a {args.target_fpr:g} share reliably"
            if info["samples"] < enough
            else ""
        )
    )
    return 0
