"""``guardrail threshold``: re-set a config's threshold on clean requests of your own traffic."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from guardrail.cli.options import add_model_arguments, resolve_model, scoring_settings
from guardrail.cli.output import write_json
from guardrail.errors import ConfigError
from guardrail.offline.calibration import retarget_threshold
from guardrail.offline.datasets import load_pairs, pairs_sha256, sample_groups
from guardrail.offline.row_scores import config_focus, scores_for
from guardrail.probe.config import read_model_config, resolve_config


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
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
        config_focus(config, table),
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
