"""The row format of ``--data`` (JSONL, what :func:`guardrail.offline.datasets.load_pairs` reads),
written once and shown in the ``--help`` of every command that takes rows.

Example:
    >>> [name for name, _ in ROW_FIELDS][:3]
    ['instruction', 'data', 'label']
    >>> print(rows_help().splitlines()[0])
    Rows (--data): JSONL files, one JSON object per line, with these fields:
"""

from __future__ import annotations

import textwrap

from guardrail.offline.layouts import LAYOUTS

__all__ = ["ROW_FIELDS", "rows_help"]

ROW_FIELDS: tuple[tuple[str, str], ...] = (
    ("instruction", "string, required: the trusted instruction"),
    ("data", "string, required: the untrusted data the instruction works on"),
    (
        "label",
        "0 (clean) or 1 (injected), on every row or on none; rows without labels are clean "
        "(calibrate and evaluate add generated injected twins of them)",
    ),
    ("id", "unique row id (default: FILE_STEM:LINE)"),
    ("task", 'task name, for per-task sampling and reports (default: "default")'),
    (
        "source",
        "group id: the rows made from one clean context stay on one side of a split (default: "
        "TASK:source_index, else the task and a hash of the instruction)",
    ),
    ("source_index", "number of the row's clean context, used when there is no source"),
    ("attack", "the injected text, verbatim in data (crop needs it on injected rows)"),
    ("attack_category", "kind of attack, for reports"),
    ("position", "where the attack sits in data: start, middle or end"),
    (
        "layout",
        f"how the row is rendered when scored: {', '.join(LAYOUTS)} (default: pair, an "
        "(instruction, data) GuardedPrompt)",
    ),
)
"""Each field a row may carry, with what it means; any other field is kept with the row."""

_EXAMPLE = '{"instruction": "Summarize the email.", "data": "Hi Sam, lunch at noon?", "label": 0}'


def rows_help(extra: tuple[tuple[str, str], ...] = ()) -> str:
    """The row format as ``--help`` text (an epilog), with ``extra`` fields a command also reads.

    Example:
        >>> "ideal" in rows_help((("ideal", "a reference answer"),))
        True
    """
    fields = ROW_FIELDS + extra
    width = max(len(name) for name, _ in fields) + 2
    lines = ["Rows (--data): JSONL files, one JSON object per line, with these fields:"]
    for name, meaning in fields:
        wrapped = textwrap.wrap(meaning, 92 - width)
        lines.append(f"  {name:<{width}}{wrapped[0]}")
        lines += [" " * (width + 2) + more for more in wrapped[1:]]
    lines.append("  Any other field is kept with the row. Example:")
    lines.append(f"  {_EXAMPLE}")
    return "\n".join(lines)
