"""The layering contracts in ``[tool.importlinter]`` (pyproject.toml) hold for the real code, and
they are not vacuous: a copy of the package with a worker module importing the guard breaks the
worker contract. ``lint-imports`` runs in a subprocess from the tree it checks (it puts its
working directory first on ``sys.path``); the real tree is only read."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = [
    pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is in the dev extra"),
    # root_packages includes vllm (so contracts can name vllm.v1 & co.)
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm installed"),
]


def _contract_names() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract["name"] for contract in config["contracts"]}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One grimp cache for both runs: vLLM's ~2,600 files are scanned once."""
    return tmp_path_factory.mktemp("import_linter_cache")


def _lint_imports(tree: Path, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tree), COLUMNS="500", NO_COLOR="1")  # one contract per line
    return subprocess.run(
        [
            str(LINT_IMPORTS),
            "--no-logo",
            "--cache-dir",
            str(cache_dir),
            str(tree / "pyproject.toml"),
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_real_code_keeps_every_contract(cache_dir: Path) -> None:
    done = _lint_imports(ROOT, cache_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    names = _contract_names()
    assert {"layers", "acyclic", "worker", "policy", "langchain", "vllm-internals"} <= set(names)
    for name in names.values():
        assert f"{name} KEPT" in done.stdout, done.stdout


def test_worker_importing_the_guard_breaks_the_worker_contract(
    tmp_path: Path, cache_dir: Path
) -> None:
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("guardrail", "integrations", "policies"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "guardrail" / "worker" / "_violation.py").write_text("import guardrail.guard\n")

    done = _lint_imports(tmp_path, cache_dir)

    assert done.returncode != 0, done.stdout
    names = _contract_names()
    assert f"{names['worker']} BROKEN" in done.stdout, done.stdout
    assert f"{names['layers']} BROKEN" in done.stdout, done.stdout
    assert "guardrail.worker._violation -> guardrail.guard (l.1)" in done.stdout, done.stdout
    assert f"{names['langchain']} KEPT" in done.stdout  # only the contracts it breaks
    assert not (ROOT / "guardrail" / "worker" / "_violation.py").exists()
