"""``guardrail.__version__`` and both commands' ``--version`` report the installed distribution."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from guardrail.integrations._serve_command import main as serve_main

import guardrail
from guardrail.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_installed_distributions() -> None:
    assert guardrail.__version__ == version("vllm-guardrail")


def test_guardrail_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"guardrail {version('vllm-guardrail')}\n"


def test_guardrail_serve_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"guardrail-serve {version('vllm-guardrail')}\n"


def test_the_console_scripts_are_the_functions_tested_here() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["guardrail"] == "guardrail.cli:main"
    assert scripts["guardrail-serve"] == "guardrail.integrations._serve_command:main"
