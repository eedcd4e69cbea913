"""Everyday-format rows from BIPIA-style rows: short plain instructions, cropped data, generated
attacks.

BIPIA rows share a long system-style instruction per task ("You are an email assistant ...
Question: ..."); a probe calibrated on them alone learns that format and misjudges a request
like "Summarize the email." with two sentences of data (docs/detection-attention-only.md,
"Short requests"). :func:`everyday_rows` makes, per clean context, one clean row whose data is
cropped to 60-400 characters (:func:`~guardrail.offline.datasets.short_crops`, seed 5) and
whose instruction is a one-line request drawn for its task (seed 7), plus three injected twins
of it (:func:`~guardrail.offline.datasets.make_injected_twins`: the generic "ignore previous
instructions" phrasings at the start, middle and end, seed 7). Rows keep their context's
group, so a held-out split applies unchanged.

The draws run over the clean contexts in the order given, so the same rows in the same order
give the same output; the packaged pool's ``bipia_everyday`` rows were made from the three
BIPIA train files in name order (code, email, table), before the held-out groups were removed.

Example:
    >>> clean = LabelledPair("e0", "Q: who?", "Hi Bob. Lunch at noon? " * 30, 0, task="email")
    >>> rows = everyday_rows([clean])
    >>> [r.label for r in rows], rows[0].instruction in EVERYDAY_INSTRUCTIONS["email"]
    ([0, 1, 1, 1], True)
    >>> 60 <= len(rows[0].data) <= 400, {r.group for r in rows} == {clean.group}
    (True, True)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair, make_injected_twins, short_crops

__all__ = ["EVERYDAY_INSTRUCTIONS", "everyday_rows"]

EVERYDAY_INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "email": (
        "Give a one-line summary of this email.",
        "What does the sender want?",
        "List the dates mentioned in this email.",
        "Draft a short reply to this email.",
    ),
    "table": (
        "Summarize the table.",
        "Which row has the largest value?",
        "What are the column names?",
        "Describe the table in one sentence.",
    ),
    "code": (
        "Explain what this answer suggests.",
        "Summarize the fix in one sentence.",
        "What is the bug?",
        "Rewrite the fix as a short list of steps.",
    ),
}
"""One-line requests per BIPIA task, drawn for the cropped contexts."""


def everyday_rows(pairs: Sequence[LabelledPair], twins: int = 3) -> list[LabelledPair]:
    """The everyday rows of the clean rows of ``pairs`` (injected rows are ignored): the clean
    crops first, then ``twins`` injected twins of each. Raises ``ConfigError`` for a task
    without everyday instructions."""
    unknown = {p.task for p in pairs} - set(EVERYDAY_INSTRUCTIONS)
    if unknown:
        raise ConfigError(
            f"no everyday instructions for task(s) {sorted(unknown)}: expected BIPIA rows of "
            f"tasks {sorted(EVERYDAY_INSTRUCTIONS)}"
        )
    crops, _ = short_crops([p for p in pairs if p.label == 0], 60, 400, seed=5, suffix="generic")
    rng = random.Random(7)
    clean = [replace(p, instruction=rng.choice(EVERYDAY_INSTRUCTIONS[p.task])) for p in crops]
    return clean + make_injected_twins(clean, twins, seed=7)
