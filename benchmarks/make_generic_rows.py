"""Everyday-format rows from BIPIA: short plain instructions, cropped data, generated attacks.

BIPIA rows share a long system-style instruction per task ("You are an email assistant ...
Question: ..."); a probe calibrated on them alone learns that format and misjudges a request
like "Summarize the email." with two sentences of data (docs/detection-attention-only.md,
"Short requests").
This writes, per clean BIPIA context, one clean row whose data is cropped to 60-400 characters
(``guardrail crop``, seed 5) and whose instruction is a one-line request drawn for its task
(seed 7), plus three injected twins of it (``make_injected_twins``: the generic "ignore previous
instructions" phrasings at the start, middle and end, seed 7). Rows keep their context's group,
so the held-out split applies unchanged. The shipped SmolLM2 config was calibrated on the full
BIPIA rows plus these.

    python benchmarks/make_generic_rows.py --data ../shared/data/bipia/bipia_*_train_pairs.jsonl \
        --out /tmp/bipia_generic.jsonl
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace
from pathlib import Path

from guardrail.offline.datasets import load_pairs, make_injected_twins, short_crops, write_pairs

INSTRUCTIONS = {
    "email": [
        "Give a one-line summary of this email.",
        "What does the sender want?",
        "List the dates mentioned in this email.",
        "Draft a short reply to this email.",
    ],
    "table": [
        "Summarize the table.",
        "Which row has the largest value?",
        "What are the column names?",
        "Describe the table in one sentence.",
    ],
    "code": [
        "Explain what this answer suggests.",
        "Summarize the fix in one sentence.",
        "What is the bug?",
        "Rewrite the fix as a short list of steps.",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pairs, _ = load_pairs(args.data)
    unknown = {p.task for p in pairs} - set(INSTRUCTIONS)
    if unknown:
        raise SystemExit(f"no everyday instructions for task(s) {sorted(unknown)}")
    crops, _ = short_crops([p for p in pairs if p.label == 0], 60, 400, seed=5, suffix="generic")
    rng = random.Random(7)
    clean = [replace(p, instruction=rng.choice(INSTRUCTIONS[p.task])) for p in crops]
    rows = clean + make_injected_twins(clean, 3, seed=7)
    write_pairs(args.out, rows)
    print(f"wrote {len(rows)} rows ({len(clean)} contexts) to {args.out}")


if __name__ == "__main__":
    main()
