"""docs/architecture.md's table of long modules and functions is the one the code gives.

scripts/draw_architecture.py writes the table; here it is regenerated in memory and compared.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "draw_architecture.py"
REFRESH = ".venv/bin/python scripts/draw_architecture.py --table"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draw_architecture", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_table_in_docs_is_the_one_the_code_gives(script: ModuleType) -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    expected = script.with_table(doc, script.long_code_table(script.long_code()))
    assert doc == expected, f"docs/architecture.md's long-code table is stale: run `{REFRESH}`"


def test_every_note_is_about_code_that_is_still_long(script: ModuleType) -> None:
    stale = script.stale_notes(script.long_code())
    assert stale == [], f"remove these NOTES from {SCRIPT.relative_to(ROOT)}: {stale}"


def test_lengths_and_names_come_from_the_def_to_the_last_line(
    script: ModuleType, tmp_path: Path
) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(script.LONG_FUNCTION - 2))
    source = textwrap.dedent('''\
        """A module."""


        class Holder:
            @staticmethod
            def long(a: int) -> int:
                """Long enough. Second sentence."""
        {body}
                return a

            def short(self) -> None:
                pass


        def outer() -> None:
            def inner() -> int:
                x = 0
        {body}
                return x
        ''').format(body=textwrap.indent(body, "    "))
    package = tmp_path / "guardrail"
    package.mkdir()
    (package / "m.py").write_text(source)
    for other in script.ROOT_PACKAGES[1:]:
        (tmp_path / other).mkdir()

    found = script.long_code(tmp_path)

    functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in functions if f.end_lineno}
    assert lengths["long"] == script.LONG_FUNCTION + 1  # def + docstring + body + return
    assert [(e.path, e.name, e.lines, e.summary) for e in found] == [
        ("guardrail/m.py", "Holder.long", lengths["long"], "Long enough."),
        ("guardrail/m.py", "outer", lengths["outer"], ""),
        ("guardrail/m.py", "outer.inner", lengths["inner"], ""),
    ]


def test_a_module_over_the_limit_is_listed_with_its_docstring(
    script: ModuleType, tmp_path: Path
) -> None:
    source = '"""Holds ``x`` | y. More."""\n' + "x = 1\n" * script.LONG_MODULE
    for package in script.ROOT_PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "policies" / "big.py").write_text(source)
    (tmp_path / "policies" / "small.py").write_text('"""Small."""\n')

    [entry] = script.long_code(tmp_path)

    assert (entry.path, entry.name, entry.lines) == ("policies/big.py", "", script.LONG_MODULE + 1)
    row = script.long_code_table([entry]).splitlines()[-1]
    assert row == r"| `policies/big.py` | 401 | Holds `x` \| y. |  |"


def test_the_table_goes_between_the_markers_and_nowhere_else(script: ModuleType) -> None:
    doc = f"before\n{script.TABLE_START}\nold\n{script.TABLE_END}\nafter\n"
    assert script.with_table(doc, "new\n") == (
        f"before\n{script.TABLE_START}\nnew\n{script.TABLE_END}\nafter\n"
    )
    with pytest.raises(ValueError, match="long-code"):
        script.with_table("no markers\n", "new\n")
