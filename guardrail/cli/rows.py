"""``guardrail split`` and ``guardrail crop``: make row files (no model needed)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from guardrail.cli.options import add_data_argument
from guardrail.offline.datasets import (
    load_pairs,
    short_crops,
    split_by_group,
    write_pairs,
    write_split,
)


def configure_split(parser: argparse.ArgumentParser) -> None:
    add_data_argument(parser, "JSONL files of rows to split by source context")
    parser.add_argument("--held-out", type=float, default=0.4, help="fraction of groups per task")
    parser.add_argument(
        "--max-held-out-groups",
        type=int,
        default=None,
        help="cap on held-out groups per task (default: no cap)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random split")
    parser.add_argument("--out", type=Path, required=True, help="split file to write (JSON)")


def run_split(args: argparse.Namespace, engine: Any) -> int:
    pairs, _ = load_pairs(args.data)
    kept, held = split_by_group(pairs, args.held_out, args.seed, args.max_held_out_groups)
    about = (
        f"held-out source contexts of {', '.join(p.name for p in args.data)}: "
        f"fraction {args.held_out} per task (cap {args.max_held_out_groups}), seed "
        f"{args.seed}; all rows of a context stay together. Calibrate with --exclude-split, "
        "evaluate with --split."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_split(args.out, held, about)
    print(f"wrote {args.out}: {len(held)} held-out rows, {len(kept)} rows left to calibrate on")
    return 0


def configure_crop(parser: argparse.ArgumentParser) -> None:
    add_data_argument(parser, "JSONL files of labelled rows to crop")
    parser.add_argument("--min-chars", type=int, default=60, help="shortest crop, in characters")
    parser.add_argument("--max-chars", type=int, default=400, help="longest crop, in characters")
    parser.add_argument("--seed", type=int, default=0, help="seed of the crop lengths")
    parser.add_argument("--suffix", default="short", help="appended to row ids: id~SUFFIX")
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")


def run_crop(args: argparse.Namespace, engine: Any) -> int:
    pairs, _ = load_pairs(args.data)
    rows, skipped = short_crops(pairs, args.min_chars, args.max_chars, args.seed, args.suffix)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_pairs(args.out, rows)
    groups = len({p.group for p in rows})
    print(
        f"wrote {args.out}: {len(rows)} short rows from {groups} contexts"
        + (f"; {skipped} injected row(s) without an 'attack' field skipped" if skipped else "")
    )
    return 0
