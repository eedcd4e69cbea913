"""``guardrail calibrate`` without ``--data``: the tiny model calibrated on the packaged pool,
end to end through the serving probe, writes a config that loads and a report beside it."""

from __future__ import annotations

import json

import pytest

from guardrail.cli import main
from guardrail.offline.datasets import pairs_sha256, sample_groups
from guardrail.offline.pool import load_pool, read_manifest
from guardrail.probe.config import read_model_config

pytest.importorskip("sklearn")


@pytest.mark.timeout(900)
def test_calibrate_on_the_packaged_pool(tiny_engine, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "cfg"
    args = ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), "--model-id", "t/ny"]
    args += ["--max-groups-per-task", "1", "--max-model-len", "2048", "--batch-size", "16"]
    assert main([*args, "--folds", "3", "--max-layers", "2"], engine=tiny_engine) == 0
    printed = capsys.readouterr().out
    manifest = read_manifest()
    for source in manifest.sources:  # every source named with its licence
        assert f"  {source.name}: " in printed and source.licence in printed

    config = read_model_config(out / "ny.json")
    config.check_fits(4, 4)
    expected = sample_groups(load_pool(), 1, 0)
    report = json.loads((out / "ny.report.json").read_text())
    skipped = {row["id"] for row in report["skipped"]["rows"]}
    assert report["skipped"]["count"] == len(skipped)  # fewer than 50: all listed
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
