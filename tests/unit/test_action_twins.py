"""benchmarks/make_action_twins.py rebuilds its rows byte for byte, and each is a clean
``diverse`` row with the attack inserted (``guardrail calibrate --add-data`` joins them there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from guardrail.offline.datasets import load_pairs

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "benchmarks" / "data"


def test_rebuilt_byte_for_byte_and_twins_of_clean_diverse_rows(tmp_path):
    out = tmp_path / "twins.jsonl"
    script = REPO / "benchmarks" / "make_action_twins.py"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True)
    assert out.read_bytes() == (DATA / "action_twins.jsonl").read_bytes()
    twins, _ = load_pairs(out)
    clean = {p.group: p for p in load_pairs(DATA / "diverse_calibration.jsonl")[0] if p.label == 0}
    assert len(twins) == len(clean) == 100
    for twin in twins:
        row = clean[twin.group]
        assert twin.label == 1 and twin.extra["corpus"] == "diverse" and twin.attack
        assert twin.instruction == row.instruction
        assert " ".join(twin.data.replace(twin.attack, "").split()) == " ".join(row.data.split())
