"""Every ```python block of README.md and docs/*.md is an excerpt of a runnable example.

Each block must appear, line for line (its common indentation removed, or added back
consistently), in the examples/*.py file ``BLOCKS`` maps it to, and every example is run by
tests/engine/test_examples.py (``run_example("name.py", ...)``), which checks what it prints.
So a doc snippet cannot drift from code that runs.

A new block fails here until it has an example: write the code as (part of) a runnable file in
examples/, run that file from tests/engine/test_examples.py, paste the lines into the doc, and
add the block to ``BLOCKS``.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ENGINE_TEST = ROOT / "tests" / "engine" / "test_examples.py"

# (doc, n-th python block of that doc, text the block starts with) -> example file
BLOCKS: dict[tuple[str, int, str], str] = {
    ("README.md", 1, "from vllm import SamplingParams"): "readme_use_it.py",
    ("docs/langchain.md", 1, "# Block below the model's calibrated"): "langchain_rag.py",
    ("docs/langchain.md", 2, "safe = model.with_fallbacks("): "langchain_fallback_and_remote.py",
    ("docs/langchain.md", 3, "for question in QUESTIONS:"): "langchain_rag.py",
    ("docs/langchain.md", 4, "# A stand-in for the remote model"): (
        "langchain_fallback_and_remote.py"
    ),
    ("docs/langchain.md", 5, "from guardrail.integrations.fakes import"): "langchain_fakes.py",
    ("docs/metrics.md", 1, "import urllib.request"): "metrics_server.py",
    ("docs/metrics.md", 2, "@asynccontextmanager"): "guarded_service.py",
    ("docs/metrics.md", 3, "# gunicorn.conf.py"): "metrics_multiprocess.py",
    ("docs/steering.md", 1, "from vllm import SamplingParams"): "steering_retry.py",
    ("docs/serving.md", 1, "client = openai.OpenAI("): "openai_client.py",
}

WHAT_TO_DO = (
    "Every ```python block of the README and docs/ must be an excerpt of a runnable file in "
    "examples/ (see the module docstring of tests/unit/test_docs_code.py): put the code in an "
    'example (with `if __name__ == "__main__":`; --model/--probe-config/--verbose when it '
    "starts an engine), run it from tests/engine/test_examples.py, copy its lines into the "
    "doc, and map the block in BLOCKS."
)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Block:
    doc: str
    n: int  # 1-based, among the doc's python blocks
    line: int  # 1-based line of the opening fence
    code: str  # dedented, without leading/trailing blank lines

    def __str__(self) -> str:
        return f"{self.doc}:{self.line} (python block {self.n})"


def python_blocks(doc: Path) -> list[Block]:
    """The ```python blocks of a Markdown file (also indented ones, e.g. in a list item)."""
    name = doc.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, start = fence["indent"], i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        if fence["lang"] == "python":
            body = [line.removeprefix(indent) for line in lines[start + 1 : end]]
            code = textwrap.dedent("\n".join(body)).strip("\n")
            blocks.append(Block(name, len(blocks) + 1, start + 1, code))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [block for doc in docs for block in python_blocks(doc)]


def contains(source: str, code: str) -> bool:
    """``code``'s lines appear consecutively in ``source``, all indented by the same prefix
    (trailing whitespace and the indentation of blank lines ignored)."""
    src = "\n" + "\n".join(line.rstrip() for line in source.splitlines()) + "\n"
    lines = [line.rstrip() for line in code.splitlines()]
    indents = {m.group(0) for m in re.finditer(r"^[ ]*", src, flags=re.MULTILINE)}
    for indent in indents:
        excerpt = "\n".join(indent + line if line else "" for line in lines)
        if "\n" + excerpt + "\n" in src:
            return True
    return False


def exercised_examples() -> set[str]:
    """The example files tests/engine/test_examples.py runs: ``run_example("x.py", ...)`` or
    ``start_example("x.py", ...)``."""
    tree = ast.parse(ENGINE_TEST.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("run_example", "start_example")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


BLOCK_IDS = [str(b) for b in all_blocks()]


@pytest.mark.parametrize("block", all_blocks(), ids=BLOCK_IDS)
def test_each_doc_block_is_an_excerpt_of_its_example(block: Block) -> None:
    mapped = {(doc, n): (start, name) for (doc, n, start), name in BLOCKS.items()}
    first = block.code.splitlines()[0] if block.code else ""
    if (block.doc, block.n) not in mapped:
        pytest.fail(f"{block} has no example (it starts {first!r}). {WHAT_TO_DO}")
    start, name = mapped[(block.doc, block.n)]
    if not block.code.startswith(start):
        pytest.fail(
            f"{block} starts {first!r}, but BLOCKS expects it to start {start!r}: a block was "
            f"added, removed or moved in {block.doc}; update BLOCKS. {WHAT_TO_DO}"
        )
    example = EXAMPLES / name
    assert example.is_file(), f"{block} maps to examples/{name}, which does not exist"
    if not contains(example.read_text(encoding="utf-8"), block.code):
        pytest.fail(
            f"{block} is not an excerpt of examples/{name}: copy the lines from the example "
            "into the doc (same lines, same relative indentation), or change the example (and "
            f"what tests/engine/test_examples.py checks of it) first.\n--- block\n{block.code}"
        )


def test_every_mapped_block_exists() -> None:
    found = {(b.doc, b.n) for b in all_blocks()}
    stale = [key for key in BLOCKS if key[:2] not in found]
    assert not stale, f"BLOCKS maps blocks that are not in the docs any more: {stale}"


def test_every_example_is_run_by_the_engine_tests() -> None:
    examples = {p.name for p in EXAMPLES.glob("*.py")}
    missing = sorted(examples - exercised_examples())
    assert not missing, (
        f"examples not run by tests/engine/test_examples.py: {missing}; add a test there that "
        "runs each one with run_example(...) and checks what it prints"
    )
    unknown = sorted(exercised_examples() - examples)
    assert not unknown, f"tests/engine/test_examples.py runs examples that do not exist: {unknown}"


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_follow_the_conventions(example: Path) -> None:
    """Runnable as a script on CPU; an example that starts an engine can be pointed at another
    model, sets a KV cache size for vLLM's CPU build and keeps vLLM's logs quiet."""
    source = example.read_text(encoding="utf-8")
    assert 'if __name__ == "__main__":' in source, (
        f'{example.name}: run the script under `if __name__ == "__main__":` (vLLM\'s CPU '
        "backend starts its engine process with spawn, which imports the script again)"
    )
    if "GuardedLLM(" not in source:
        return
    for needed in (
        '"--model"',
        '"--probe-config"',
        '"--verbose"',
        "quiet_engine_logs(args.verbose)",
        'os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE"',
    ):
        assert needed in source, f"{example.name} starts an engine but has no {needed}"


def test_the_steering_example_policy_is_retry_steered() -> None:
    """docs/steering.md's block says its policy, with no vector given, is RETRY_STEERED."""
    from guardrail.policies import RETRY_STEERED

    from guardrail.policy import PromptInjectionPolicy, RetrySettings

    retry = PromptInjectionPolicy(
        name="retry_steered", action="retry_with_steering", retry=RetrySettings(vector=None)
    )
    assert retry == RETRY_STEERED


def test_the_excerpt_check_itself() -> None:
    source = "def f():\n    a = 1\n\n    b = 2\n"
    assert contains(source, "a = 1\n\nb = 2")
    assert contains(source, "    a = 1")
    assert not contains(source, "a = 1\nb = 2")  # lines must be consecutive
    assert not contains(source, "a = 1\n  b = 2")  # and keep their relative indentation
    assert not contains(source, "a = 12")  # whole lines only
    doc = ROOT / "README.md"
    assert python_blocks(doc), "README.md has a python block"
