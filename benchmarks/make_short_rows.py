"""Short-context rows from BIPIA: each clean context cropped, with the same context's attacks.

BIPIA contexts are long (emails of a few hundred tokens, tables up to ~1,100); requests in the
wild often carry a sentence or two. This writes, per source context, one clean row with the
data cut to its first 60-400 characters (at a word boundary, length drawn per context, seeded)
and one injected row per BIPIA attack of that context, inserted into the cropped data at the
attack's own position. Rows keep their context's group (``source``), so a split file made on
the full rows (``guardrail split``) applies to them unchanged.

    python benchmarks/make_short_rows.py --data ../shared/data/bipia/bipia_*_train_pairs.jsonl \
        --out /tmp/bipia_short.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

from guardrail.datasets import LabelledPair, insert_at, load_pairs


def crop(text: str, limit: int) -> str:
    """The first ``limit`` characters of ``text``, cut back to the last space."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    return cut[: cut.rfind(" ")] if " " in cut else cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-chars", type=int, default=60)
    parser.add_argument("--max-chars", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pairs, labelled = load_pairs(args.data)
    if not labelled:
        raise SystemExit("--data must be labelled rows (clean and injected of each context)")
    rng = random.Random(args.seed)
    clean = {p.group: p for p in pairs if p.label == 0}
    attacks: dict[str, list[LabelledPair]] = defaultdict(list)
    for p in pairs:
        if p.label == 1 and p.attack:
            attacks[p.group].append(p)
    rows = []
    for group, pair in clean.items():
        data = crop(pair.data, rng.randint(args.min_chars, args.max_chars))
        base = {"instruction": pair.instruction, "task": pair.task, "source": group}
        rows.append({**base, "id": f"{pair.id}~short", "data": data, "label": 0})
        for attack in attacks[group]:
            rows.append(
                {
                    **base,
                    "id": f"{attack.id}~short",
                    "data": insert_at(data, attack.attack or "", attack.position or "end"),
                    "label": 1,
                    "attack_category": attack.attack_category,
                    "attack": attack.attack,
                    "position": attack.position,
                }
            )
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows ({len(clean)} contexts) to {args.out}")


if __name__ == "__main__":
    main()
