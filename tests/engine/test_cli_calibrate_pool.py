"""``guardrail calibrate`` without ``--data``: the tiny model calibrated on the packaged pool,
end to end through the serving probe, writes both configs (attention-only and combined) that
load, and the report beside them (each source left out, clean rows flagged per layout, ROC);
a second run from the score cache rewrites every file byte for byte, with the token models
fitted again and with them read from their cache.

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
def test_calibrate_on_the_packaged_pool(tiny_hidden_engine, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "cfg"
    args = ["calibrate", "--model", str(tiny_llama_dir), "--model-id", "t/ny"]
    args += ["--max-groups-per-task", "1", "--max-model-len", str(CONTEXT), "--batch-size", "16"]
    args += ["--max-prompt-tokens", str(CAP), "--scores-cache", str(tmp_path / "scores.npz")]
    assert main([*args, "--out", str(out)], engine=tiny_hidden_engine) == 0
    captured = capsys.readouterr()
    printed = captured.out
    # the steps between scoring and fitting say how long they took (invisible otherwise)
    assert f"score cache {tmp_path / 'scores.npz'} saved (" in captured.err
    assert "rows' scores gathered in" in captured.err and "rows ready after" in captured.err
    manifest = read_manifest()
    for source in manifest.sources:  # every source named with its licence
        assert f"  {source.name}: " in printed and source.licence in printed

    config = read_model_config(out / "ny.json")
    config.check_fits(4, 4)
    assert not config.hidden  # the attention-only config: it runs in any engine mode
    combined = read_model_config(out / "ny.combined.json")
    combined.check_fits(4, 4)
    # the generic recipe: stream layers 0-2 ranked, the best two read at the last token and
    # the first of them averaged over the data tokens
    (last, mean) = (
        {p.layer for p in combined.hidden or [] if p.position == k} for k in ("last", "data_mean")
    )
    report = json.loads((out / "ny.report.json").read_text())
    chosen = report["fits"]["combined"]
    assert len(chosen["last_layers"]) == 2 and set(chosen["last_layers"]) <= {0, 1, 2}
    assert chosen["data_mean_layers"] == chosen["last_layers"][:1]
    assert last <= set(chosen["last_layers"]) and mean <= set(chosen["data_mean_layers"])
    # the token read-out over three layers (--token-layers' default): the data-mean layer and
    # the next best-ranked candidates (here all three); a model per fold (3) and one on all
    # rows, for the pool and each source left out (6 sources, BIPIA's two leaving together:
    # 6 scopes), per C (3); every C and k tried, kept only where it beat the fit without it
    token = report["token_readout"]
    assert token["models"] == 7 * 3 * 4 and len(token["cv_auroc"]) == 1 + 3 * 5
    assert token["layers"] == [0, 1, 2] and chosen["data_mean_layers"][0] in token["layers"]
    tops = [p for p in combined.hidden or [] if p.position == "data_top"]
    if token["chosen"] is None:
        assert not tops and max(token["cv_auroc"].values()) <= token["cv_auroc"]["none"] + 1e-4
    else:  # one data_top part per layer, one token model: its column keyed by the last layer
        assert [p.layer for p in tops] == token["layers"]
        assert {(p.top_k, len(p.dims)) for p in tops} == {(token["chosen"][1], 128)}
        assert chosen["data_top"] == {
            "2": {"top_k": token["chosen"][1], "c": token["chosen"][0], "layers": [0, 1, 2]}
        }
    assert (tmp_path / "scores.token-logits.npz").is_file()
    assert combined.hidden_size == 128 and combined.num_layers == 4
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
    for written in (config, combined):
        assert written.calibration is not None
        assert written.calibration.num_examples == len(kept)
        assert written.calibration.sha256 == pairs_sha256(kept)
        assert "calibration pool installed with vllm-guardrail" in written.calibration.dataset
        assert written.source.startswith("guardrail calibrate: ")

    # the pool fit out of fold: every source and layout, counts that add up to the rows
    for kind in ("attention", "combined"):
        table = report["out_of_fold"][kind]
        assert set(table) == {s.name for s in manifest.sources}
        assert sum(t["all"]["n_clean"] + t["all"]["n_injected"] for t in table.values()) == len(
            kept
        )
        layouts = {p.extra["layout"] for p in kept}
        assert {lay for t in table.values() for lay in t} == layouts | {"all"}
    # each source left out: both kinds, its own rows, every layout it has
    by_source = {s.name: [p for p in kept if p.extra["corpus"] == s.name] for s in manifest.sources}
    assert set(report["left_out"]) == set(by_source)
    for name, results in report["left_out"].items():
        assert set(results) == {"attention", "combined"}
        assert results["combined"]["all"]["n_clean"] == sum(p.label == 0 for p in by_source[name])
        assert set(results["combined"]) == {p.extra["layout"] for p in by_source[name]} | {"all"}
    markdown = (out / "ny.report.md").read_text()
    assert markdown.startswith("# t/ny: ") and "## Leave one source out" in markdown
    assert "## Per prompt layout, combined probe, each source left out" in markdown
    if pytest.importorskip("matplotlib"):
        assert (out / "ny.report.png").stat().st_size > 5000

    # rebuilt from the score cache (nothing scored again): the same files, byte for byte; first
    # with the token models fitted again, then with them read from their cache
    models = tmp_path / "scores.token-models.npz"
    assert models.is_file()
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 5
    for rebuilt, cached in (("again", False), ("resumed", True)):
        if not cached:
            models.unlink()
        before = models.stat().st_mtime_ns if cached else None
        assert main([*args, "--out", str(tmp_path / rebuilt)]) == 0
        # fitted again: the cache written anew; read: the file left as it was
        assert models.is_file() and (models.stat().st_mtime_ns == before) == cached
        assert names == sorted(p.name for p in (tmp_path / rebuilt).iterdir())
        for name in names:
            assert (out / name).read_bytes() == (tmp_path / rebuilt / name).read_bytes(), name
