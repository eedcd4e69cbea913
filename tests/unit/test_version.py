"""``guardrail.__version__`` and both commands' ``--version`` report the installed distribution."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

import guardrail
from guardrail.cli import main


def test_version_is_the_installed_distributions() -> None:
    assert guardrail.__version__ == version("vllm-guardrail")


def test_guardrail_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"guardrail {version('vllm-guardrail')}\n"


def test_guardrail_serve_version_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "guardrail.integrations.serving", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout == f"guardrail-serve {version('vllm-guardrail')}\n"
