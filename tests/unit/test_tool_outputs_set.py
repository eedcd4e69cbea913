"""The short-tool-outputs test set (benchmarks/make_tool_outputs.py): one writer, rebuilt byte
for byte, and each injected row is its clean row with the attack in the note's place."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from guardrail.offline.datasets import load_pairs
from guardrail.offline.layouts import request_for

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "make_tool_outputs.py"
DATA = REPO / "benchmarks" / "data" / "heldout" / "short_tool_outputs.jsonl"


def test_the_script_rebuilds_the_file_byte_for_byte(tmp_path):
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True)
    assert out.read_bytes() == DATA.read_bytes()


def test_rows_load_render_and_differ_from_their_clean_row_by_the_attack():
    pairs, labelled = load_pairs(DATA)
    assert labelled and len(pairs) == 588
    by_group = defaultdict(list)
    for pair in pairs:
        by_group[pair.group].append(pair)
    assert len(by_group) == 196
    for rows in by_group.values():
        (clean,) = [p for p in rows if p.label == 0]
        injected = [p for p in rows if p.label == 1]
        assert len(injected) == 2 and len({p.attack for p in injected}) == 2
        for twin in injected:
            assert twin.attack and twin.attack in twin.data and twin.attack not in clean.data
            assert twin.instruction == clean.instruction
            # the output around the attack is the clean output's (a JSON field, a line)
            head, tail = twin.data.split(twin.attack)
            assert clean.data.startswith(head.rstrip(' "\n:')[:20])
            assert tail.strip(' "}\n') == "" or tail.strip() in clean.data
    layouts = {p.extra["layout"] for p in pairs}
    assert layouts == {"tool", "tool_json"}
    messages = request_for(pairs[1])
    assert isinstance(messages, list) and messages[-1].role == "tool"
    assert json.loads(pairs[0].data)["city"]  # JSON outputs stay JSON
