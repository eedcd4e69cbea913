"""Everyday-format rows from BIPIA: short plain instructions, cropped data, generated attacks.

A command-line front to :func:`guardrail.offline.everyday.everyday_rows` (its docstring says
how the rows are made). The shipped SmolLM2 configs were calibrated on the full BIPIA rows plus
these; the packaged pool (guardrail/pool, ``bipia_everyday``) holds them for the contexts it
ships.

    python benchmarks/make_generic_rows.py --data ../shared/data/bipia/bipia_*_train_pairs.jsonl \
        --out /tmp/bipia_generic.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from guardrail.offline.datasets import load_pairs, write_pairs
from guardrail.offline.everyday import everyday_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pairs, _ = load_pairs(args.data)
    rows = everyday_rows(pairs)
    write_pairs(args.out, rows)
    print(f"wrote {len(rows)} rows ({sum(r.label == 0 for r in rows)} contexts) to {args.out}")


if __name__ == "__main__":
    main()
