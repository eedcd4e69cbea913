"""The core package works without LangChain: imports in a subprocess where ``langchain_core``
cannot be imported, and a static check that no core module imports it (or the integrations)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import guardrail

BLOCKED = ("langchain_core", "langchain", "langsmith")

SCRIPT = f"""
import importlib.abc, sys

BLOCKED = {BLOCKED!r}
attempts = []

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path.insert(0, Block())
import guardrail, guardrail.engine, guardrail.guard, guardrail.policy, guardrail.metrics
import guardrail.integrations, guardrail.policies
from guardrail import HookedLLM, PromptInjectionBlocked, Verdict
assert attempts == [], attempts
assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), "a LangChain module was loaded"
for adapter in ("guardrail.integrations.langchain", "guardrail.integrations.fakes"):
    try:
        __import__(adapter)
    except ImportError as exc:
        assert "pip install 'vllm-guardrail[langchain]'" in str(exc), exc
    else:
        raise AssertionError(adapter + " imported without langchain-core")
print("ok")
"""


def test_core_imports_without_langchain_core() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_no_core_module_imports_langchain_or_the_integrations() -> None:
    offenders = []
    for source in Path(guardrail.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in BLOCKED or name.startswith("guardrail.integrations"):
                    offenders.append(f"{source.name}: {name}")
    assert offenders == []
