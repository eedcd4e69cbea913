"""``guardrail calibrate`` without ``--data``: the tiny model calibrated on the packaged pool,
end to end through the serving probe, writes a config that loads and a report beside it.

Rows over 1,536 prompt tokens are left out with ``--max-prompt-tokens`` (28 of the 448 rows
sampled, a fifth of the tokens to score: the test's time), and those over the engine's
2,048-token context (4) as without it; both reasons for a skip are checked against the rows'
own lengths."""

from __future__ import annotations

import json

import pytest

from guardrail.cli import main
from guardrail.offline.datasets import pairs_sha256, sample_groups
from guardrail.offline.layouts import request_for
from guardrail.offline.pool import load_pool, read_manifest
from guardrail.probe.config import read_model_config
from guardrail.probe.prompts import prepare_prompt

CONTEXT, CAP = 2048, 1536  # --max-model-len (the shared engine's too), --max-prompt-tokens

pytest.importorskip("sklearn")


@pytest.mark.timeout(900)
def test_calibrate_on_the_packaged_pool(tiny_engine, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "cfg"
    args = ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), "--model-id", "t/ny"]
    args += ["--max-groups-per-task", "1", "--max-model-len", str(CONTEXT), "--batch-size", "16"]
    args += ["--max-prompt-tokens", str(CAP)]
    assert main([*args, "--folds", "3", "--max-layers", "2"], engine=tiny_engine) == 0
    printed = capsys.readouterr().out
    manifest = read_manifest()
    for source in manifest.sources:  # every source named with its licence
        assert f"  {source.name}: " in printed and source.licence in printed

    config = read_model_config(out / "ny.json")
    config.check_fits(4, 4)
    expected = sample_groups(load_pool(), 1, 0)
    report = json.loads((out / "ny.report.json").read_text())
    skipped = {row["id"]: row["reason"] for row in report["skipped"]["rows"]}
    assert report["skipped"]["count"] == len(skipped)  # fewer than 50: all listed
    # each skip for its length, as the tiny model's own tokenizer counts it
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    length = {p.id: len(prepare_prompt(request_for(p), tokenizer).token_ids) for p in expected}
    assert {i for i, n in length.items() if n >= CONTEXT} == {
        i for i, why in skipped.items() if "max_model_len" in why
    }
    assert {i for i, n in length.items() if CAP < n < CONTEXT} == {
        i for i, why in skipped.items() if f"--max-prompt-tokens {CAP}" in why
    }
    assert all(length[i] > CAP for i in skipped)  # the probe scored every row that fit
    kept = [p for p in expected if p.id not in skipped]
    assert config.calibration is not None
    assert config.calibration.num_examples == report["rows"] == len(kept)
    assert config.calibration.sha256 == pairs_sha256(kept)
    assert "calibration pool installed with vllm-guardrail" in config.calibration.dataset

    # the per-source table: every source, counts that add up to the rows calibrated on
    table = report["per_source"]
    assert set(table) == {s.name for s in manifest.sources} | {"all"}
    assert sum(
        table[s.name]["n_clean"] + table[s.name]["n_injected"] for s in manifest.sources
    ) == len(kept)
    assert table["all"]["n_clean"] == sum(p.label == 0 for p in kept)
    assert (out / "ny.report.md").read_text().startswith("# t/ny: ")
    if pytest.importorskip("matplotlib"):
        assert (out / "ny.report.png").stat().st_size > 5000
