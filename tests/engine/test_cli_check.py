"""``guardrail check`` on the shared tiny engine: its printed facts are the engine's own."""

from __future__ import annotations

import json
from typing import Any

import pytest

from guardrail.cli import main


def test_check_prints_what_the_engine_runs(tiny_engine: Any, capsys: pytest.CaptureFixture[str]):
    assert main(["check", "--json"], engine=tiny_engine) == 0
    facts = json.loads(capsys.readouterr().out)
    info = tiny_engine.model_info
    assert facts["attention_backend"] == info["backend"]
    assert facts["dtype"] == "float32"  # the tests' engines ask for it
    assert facts["graph_mode"] == "eager" and facts["steering"] is True
    assert facts["block_size"] == info["block_size"] == 32
    assert facts["probe"]["heads"] == len(tiny_engine.config.heads)
    assert facts["probe"]["calibrated"] is (tiny_engine.config.calibration is not None)
    points = tiny_engine.config.operating_points
    assert facts["probe"]["operating_points"] == {f"{r:g}": t for r, t in points.items()}

    assert main(["check"], engine=tiny_engine) == 0
    text = capsys.readouterr().out
    assert f"attention        {info['backend']}" in text
    if tiny_engine.config.calibration is None:
        assert "NOT calibrated" in text and "guardrail calibrate" in text
    assert ("operating points " in text) is bool(points)
