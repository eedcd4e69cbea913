"""Draw the package diagram (docs/img/architecture.png) from the code's real imports.

grimp (import-linter's graph builder) scans ``guardrail``, ``integrations`` and ``policies``
(installed as ``guardrail.integrations`` / ``guardrail.policies``); every module is squashed to
its subpackage or top module, and each dependency between two of them becomes one edge. Rows
are the layers of the ``layers`` contract in pyproject.toml ``[tool.importlinter]``, with the
adapters on top and the two external packages the contracts talk about (vLLM, LangChain) at the
bottom. An edge is dashed when every import behind it is deferred (inside a function or under
``if TYPE_CHECKING``), and red when it points up or sideways within a layer (a contract breaks).

The same run rewrites the table of long modules and functions in docs/architecture.md (between
the ``long-code`` marker comments) from the code: every module of those three packages over
``LONG_MODULE`` lines and every function or method over ``LONG_FUNCTION`` lines (from its
``def`` line to its last, as ``ast`` gives them), with its docstring's first sentence and the
note in ``NOTES``, if any. tests/unit/test_long_code_inventory.py fails when the table is stale.

    .venv/bin/python scripts/draw_architecture.py            # needs graphviz's `dot` on PATH
    .venv/bin/python scripts/draw_architecture.py --dot      # print the DOT source only
    .venv/bin/python scripts/draw_architecture.py --table    # rewrite the table only
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"integrations": "guardrail.integrations", "policies": "guardrail.policies"}
ROOT_PACKAGES = ("guardrail", *INSTALLED_AS)
EXTERNALS = ("vllm", "langchain_core")
VLLM_INTERNALS = "vllm internals"
FACADE = "guardrail"
QUIET_TARGETS = {"guardrail.errors"}  # drawn in light grey, as are the facade's edges
COLORS = {  # fill colour per group of nodes
    "guardrail.integrations": "#f6e3c6",
    "guardrail.policies": "#f6e3c6",
    "guardrail.cli": "#e4e4e4",
    "guardrail.testing": "#e4e4e4",
    "guardrail.offline": "#e4e4e4",
    "guardrail.worker": "#f4cccc",
    "guardrail.protocol": "#d9ead3",
    "guardrail.errors": "#d9ead3",
    "guardrail.probe": "#d9ead3",
    "guardrail.steering": "#d9ead3",
    "guardrail.embedded": "#e4e4e4",
}
CALLER_COLOR = "#cfe2f3"  # guard, metrics, engine, policy
EXTERNAL_COLOR = "#ffffff"

ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
LONG_MODULE = 400  # lines; house style: modules under ~400 lines, functions under ~50
LONG_FUNCTION = 60
TABLE_START = "<!-- long-code:start -->"
TABLE_END = "<!-- long-code:end -->"
# Why a long module or function stays long, keyed like the table's first column (path, or
# "path: qualified name"). A note whose subject is no longer long fails the inventory test.
NOTES = {
    "guardrail/embedded.py": (
        "GGUF to safetensors conversion with a file lock, atomic rename, manifest and "
        "verification: one procedure, kept in one place."
    ),
    "guardrail/metrics/recorder.py: GuardrailMetrics._define": (
        "Declarations only: one `Counter`/`Histogram`/`Gauge` per metric, with help text "
        "and labels."
    ),
    "guardrail/offline/calibration.py": (
        "Already separate from datasets, evaluation and the CLI; could be split into "
        "`selection` and `logistic` modules."
    ),
    "guardrail/offline/datasets.py": (
        "Many small pieces; `ScoreTable` could move to its own module."
    ),
    "guardrail/offline/evaluation.py: markdown_report": "Mostly literal Markdown text.",
    "guardrail/probe/config.py: ModelProbeConfig.check_model": (
        "About half of it is docstring and message text."
    ),
    "guardrail/probe/fused_stats.py: span_stats_into": (
        "Half of it is the kernel's argument list, passed positionally as Triton requires."
    ),
    "guardrail/worker/probe.py": (
        "Planning, per-layer scoring (the kernel and the PyTorch path) and the end of step of one "
        "object; the results wait in worker/results.py."
    ),
    "guardrail/probe/prompts.py": (
        "Rendering requests safely is one procedure with several guarantees; docs/security.md "
        "says what each part guarantees."
    ),
}


def importlinter_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def contract(config: dict, contract_id: str) -> dict:
    return next(c for c in config["contracts"] if c.get("id") == contract_id)


def node_of(module: str, line: str = "") -> str | None:
    """The diagram node of a module: its subpackage or top module, or a tracked external."""
    top, *rest = module.split(".")
    if top in INSTALLED_AS:
        return INSTALLED_AS[top]
    if top == "guardrail":
        if not rest:
            # grimp resolves `guardrail.integrations.x` / `guardrail.policies.x` to the root module,
            # since those live outside guardrail/ on disk: the import line says which it was.
            named = re.search(r"\bguardrail\.(integrations|policies)\b", line)
            return f"guardrail.{named.group(1)}" if named else FACADE
        return f"guardrail.{rest[0]}"
    return top if top in EXTERNALS else None


@functools.cache
def source_file(module: str) -> Path:
    top, *rest = module.split(".")
    base = ROOT.joinpath(top, *rest)
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@functools.cache
def deferred_lines(module: str) -> frozenset[int]:
    """Line numbers of the imports in a module that run after import time: inside a function
    or under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source_file(module).read_text())
    found: set[int] = set()

    def visit(node: ast.AST, deferred: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom) and deferred:
            found.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        for child in ast.iter_child_nodes(node):
            inside = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            guarded = (
                isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test)
                and child in node.body
            )
            visit(child, deferred or inside or guarded)

    visit(tree, False)
    return frozenset(found)


def vllm_target(line: str, internals: list[str]) -> str:
    """``vllm`` (public API) or the internals node, from the import statement's text."""
    named = re.match(r"\s*(?:from|import)\s+(vllm[\w.]*)", line)
    module = named.group(1) if named else "vllm"
    hit = any(module == m or module.startswith(m + ".") for m in internals)
    return VLLM_INTERNALS if hit else "vllm"


def edges(graph: grimp.ImportGraph, internals: list[str]) -> dict[tuple[str, str], list[bool]]:
    """(importer node, imported node) -> one flag per import: is it deferred?"""
    found: dict[tuple[str, str], list[bool]] = collections.defaultdict(list)
    for importer in sorted(graph.modules):
        source = node_of(importer)
        if importer.split(".")[0] not in ROOT_PACKAGES or source is None:
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                line = detail["line_contents"]
                target = node_of(imported, line)
                if target == "vllm":
                    target = vllm_target(line, internals)
                if target is None or target == source:
                    continue
                found[source, target].append(detail["line_number"] in deferred_lines(importer))
    return found


def rows(config: dict) -> list[list[str]]:
    """Top to bottom: the adapters and the facade, the layers contract's layers, externals."""
    layers = [
        [name.strip() for name in re.split(r"[|:]", layer)]
        for layer in contract(config, "layers")["layers"]
    ]
    return [[*INSTALLED_AS.values(), FACADE], *layers, [VLLM_INTERNALS, "vllm", *EXTERNALS[1:]]]


def module_counts(graph: grimp.ImportGraph) -> Iterator[tuple[str, int, int]]:
    per_node: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for module in graph.modules:
        if module.split(".")[0] in ROOT_PACKAGES and module != FACADE:
            count = per_node[node_of(module) or module]
            count[0] += 1
            count[1] += len(source_file(module).read_text().splitlines())
    for node, (modules, lines) in per_node.items():
        yield node, modules, lines


def node_line(node: str, sizes: dict[str, tuple[int, int]], internals: list[str]) -> str:
    if node in sizes:
        modules, lines = sizes[node]
        detail = f"{modules} modules, {lines} lines" if modules > 1 else f"{lines} lines"
        return (
            f'  "{node}" [label="{node}\\n{detail}", fillcolor="{COLORS.get(node, CALLER_COLOR)}"];'
        )
    if node == FACADE:
        return f'  "{node}" [label="guardrail (__init__: public API)", fillcolor="#ffffff"];'
    label = node
    if node == VLLM_INTERNALS:
        names = [m.removeprefix("vllm.") for m in internals]
        half = (len(names) + 1) // 2
        label += f"\\n{', '.join(names[:half])}\\n{', '.join(names[half:])}"
    return (
        f'  "{node}" [label="{label}", shape=ellipse, style=dashed, fillcolor="{EXTERNAL_COLOR}"];'
    )


def to_dot(graph: grimp.ImportGraph, config: dict) -> str:
    internals = contract(config, "vllm-internals")["protected_modules"]
    found = edges(graph, internals)
    layout = rows(config)
    rank = {node: i for i, row in enumerate(layout) for node in row}
    sizes = {node: (m, n) for node, m, n in module_counts(graph)}
    out = [
        "digraph architecture {",
        '  graph [rankdir=TB, nodesep=0.35, ranksep=0.55, fontname="Helvetica", fontsize=11,',
        '         labelloc=b, label="Arrows point from importer to imported. Dashed: only'
        " deferred imports (in a function or under TYPE_CHECKING).\\nRed: an import up or"
        " sideways (breaks a contract). Grey: edges out of the public-API facade and into"
        ' guardrail.errors. Generated by scripts/draw_architecture.py."];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11];',
        '  edge [color="#555555", arrowsize=0.7];',
    ]
    for i, row in enumerate(layout):
        quoted = " ".join(f'"{n}"' for n in row)
        out.append(f"  {{ rank=same; {quoted} }}")
        out.extend(node_line(node, sizes, internals) for node in row)
        if i:  # keep the rows in order even where no edge links them
            out.append(f'  "{layout[i - 1][0]}" -> "{row[0]}" [style=invis];')
    for (source, target), flags in sorted(found.items()):
        attrs = []
        if all(flags):
            attrs.append("style=dashed")
        if rank.get(source, 0) >= rank.get(target, 99) and source != FACADE:
            attrs.append('color="#cc0000", penwidth=2')
        elif source == FACADE or target in QUIET_TARGETS:
            attrs.append('color="#b0b0b0"')  # everything imports them: keep them in the back
        out.append(f'  "{source}" -> "{target}"' + (f" [{', '.join(attrs)}];" if attrs else ";"))
    out.append("}")
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class LongCode:
    """A module over ``LONG_MODULE`` lines or a function over ``LONG_FUNCTION`` lines."""

    path: str  # relative to the repository root
    name: str  # qualified name of the function ("Class.method", "outer.inner"); "" for a module
    lines: int
    summary: str  # the first sentence of its docstring

    @property
    def key(self) -> str:
        return f"{self.path}: {self.name}" if self.name else self.path


def docstring_summary(node: ast.Module | ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The first sentence of a docstring, as Markdown on one line (pipes escaped)."""
    paragraph = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
    sentence = re.split(r"(?<=\.)\s+(?=[A-Z`])", paragraph)[0]
    sentence = re.sub(r":\w+:`([^`]+)`", r"`\1`", sentence).replace("``", "`")
    return sentence.replace("|", "\\|")


def long_code(root: Path = ROOT) -> list[LongCode]:
    """The long modules and functions of ``ROOT_PACKAGES``, file by file, in source order."""
    found: list[LongCode] = []

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > LONG_FUNCTION:
                    found.append(LongCode(path, name, lines, docstring_summary(child)))
                visit(child, path, name + ".")
            else:
                visit(child, path, prefix)

    for package in ROOT_PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            path = file.relative_to(root).as_posix()
            source = file.read_text()
            tree = ast.parse(source)
            lines = len(source.splitlines())
            if lines > LONG_MODULE:
                found.append(LongCode(path, "", lines, docstring_summary(tree)))
            visit(tree, path, "")
    return found


def long_code_table(found: list[LongCode]) -> str:
    """The Markdown table of ``found``, with each entry's note from ``NOTES``."""
    out = ["| Where | Lines | Summary (its docstring) | Note |", "|---|---:|---|---|"]
    for entry in found:
        where = f"`{entry.path}`" + (f": `{entry.name}`" if entry.name else "")
        out.append(f"| {where} | {entry.lines} | {entry.summary} | {NOTES.get(entry.key, '')} |")
    return "\n".join(out) + "\n"


def stale_notes(found: list[LongCode]) -> list[str]:
    """The keys of ``NOTES`` whose module or function is no longer long (or no longer there)."""
    keys = {entry.key for entry in found}
    return sorted(key for key in NOTES if key not in keys)


def with_table(doc: str, table: str) -> str:
    """``doc`` with the text between the long-code markers replaced by ``table``."""
    start, end = doc.find(TABLE_START), doc.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{ARCHITECTURE_DOC.name} needs {TABLE_START} ... {TABLE_END}")
    return f"{doc[: start + len(TABLE_START)]}\n{table}{doc[end:]}"


def write_table() -> None:
    found = long_code()
    for key in stale_notes(found):
        print(f"NOTES[{key!r}] is about code that is no longer long: remove it", file=sys.stderr)
    text = ARCHITECTURE_DOC.read_text()
    updated = with_table(text, long_code_table(found))
    if updated != text:
        ARCHITECTURE_DOC.write_text(updated)
    print(f"{ARCHITECTURE_DOC.relative_to(ROOT)}: {len(found)} long modules and functions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "architecture.png")
    parser.add_argument("--dot", action="store_true", help="print the DOT source, draw nothing")
    parser.add_argument(
        "--table", action="store_true", help="rewrite the long-code table only, draw nothing"
    )
    args = parser.parse_args(argv)
    if not args.dot:
        write_table()
    if args.table:
        return 0

    sys.path.insert(0, str(ROOT))  # `integrations` and `policies` as grimp sees them
    print(f"scanning {', '.join(ROOT_PACKAGES)} ...", file=sys.stderr)
    graph = grimp.build_graph(*ROOT_PACKAGES, include_external_packages=True, cache_dir=None)
    dot_source = to_dot(graph, importlinter_config())
    if args.dot:
        sys.stdout.write(dot_source)
        return 0
    dot = shutil.which("dot")
    if dot is None:
        print("graphviz's `dot` is not on PATH (apt-get install graphviz)", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = [dot, "-Tpng", "-Gdpi=110", "-o", str(args.out)]
    subprocess.run(command, input=dot_source.encode(), check=True)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
