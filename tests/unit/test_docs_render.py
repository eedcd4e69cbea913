"""README.md, THIRD_PARTY_NOTICES.md and docs/*.md render and point at things that exist.

- Every markdown table has a delimiter row, and every row has as many cells as its header (a
  row with one cell too many is silently dropped or shifted by GitHub's renderer).
- Every relative link resolves to a file or folder of the repository.
- Every repository path written in backticks (``model_configs/...json``, ``benchmarks/...``,
  ``docs/...``, ...) names a file that exists: a config, script or data file a doc names and
  the repository lacks is a doc that lies.
- Every ``model_configs/<file>`` a doc names anywhere, code blocks included, exists: a command
  that reads a config the repository no longer ships fails for whoever copies it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    ROOT / "THIRD_PARTY_NOTICES.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
DELIMITER = re.compile(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(
    r"`((?:model_configs|benchmarks|docs|guardrail|tests|scripts|examples|integrations|policies"
    r"|monitoring|licenses)/[A-Za-z0-9_./-]*\.[a-z]+)`"
)
MODEL_CONFIG_FILE = re.compile(r"\bmodel_configs/[A-Za-z0-9_.-]+\.(?:json|safetensors)\b")


def cell_count(line: str) -> int:
    """Cells of a table row: code spans and escaped pipes hold no cell boundary."""
    line = re.sub(r"`[^`]*`", "x", line.strip()).replace("\\|", "x")
    return len(line.strip("|").split("|"))


def table_problems(text: str) -> list[str]:
    """What would not render in ``text``'s tables, as 'line N: ...' (fenced code skipped)."""
    problems, lines, fenced, i = [], text.splitlines(), False, 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not lines[i].lstrip().startswith("|"):
            i += 1
            continue
        end = i
        while end < len(lines) and lines[end].lstrip().startswith("|"):
            end += 1
        header = cell_count(lines[i])
        if end - i < 2 or not DELIMITER.fullmatch(lines[i + 1].strip()):
            problems.append(f"line {i + 1}: a table without a delimiter row (|---|)")
        for n in range(i + 1, end):
            if cell_count(lines[n]) != header:
                problems.append(
                    f"line {n + 1}: {cell_count(lines[n])} cells, the header has {header}"
                )
        i = end
    return problems


def test_table_check_itself() -> None:
    good = "| a | b |\n|---|---|\n| `x|y` | 2 |\n"
    assert table_problems(good) == []
    assert table_problems("| a | b |\n|---|---|---|\n") == ["line 2: 3 cells, the header has 2"]
    assert table_problems("| a | b |\n| 1 | 2 |\n")[0].startswith("line 1: a table without")
    assert table_problems("```\n| a |\n| 1 | 2 |\n```\n") == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_renders(doc: Path) -> None:
    assert table_problems(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_named_path_exists(doc: Path) -> None:
    text = doc.read_text()
    links = [t for t in LINK.findall(text) if "://" not in t and not t.startswith("mailto:")]
    missing = [t for t in links if not (doc.parent / t).exists()]
    missing += [p for p in REPO_PATH.findall(text) if not (ROOT / p).exists()]
    assert missing == []


def test_model_config_paths_are_found_in_code_blocks_too() -> None:
    text = "run `x`\n```bash\nguardrail evaluate --config model_configs/Gone.json \\\n```\n"
    assert MODEL_CONFIG_FILE.findall(text) == ["model_configs/Gone.json"]
    assert MODEL_CONFIG_FILE.findall("--out model_configs --name x") == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_model_config_file_exists(doc: Path) -> None:
    named = sorted(set(MODEL_CONFIG_FILE.findall(doc.read_text())))
    assert [p for p in named if not (ROOT / p).is_file()] == []
