"""The calibrate / evaluate / split commands end to end on the tiny model, and the data layer.

Scores of a random tiny model mean nothing as detection; these tests check that rows go
through the real serving probe, that what calibrate writes loads and validates, and that
evaluate's numbers are the ones its config computes on the probe's head scores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guardrail.cli import SUBCOMMANDS, build_parser, load_detectors, main, score_pairs
from guardrail.errors import ConfigError
from guardrail.offline.datasets import (
    LabelledPair,
    ScoreTable,
    insert_at,
    load_pairs,
    make_injected_twins,
    pairs_sha256,
    read_split,
    split_by_group,
)
from guardrail.probe.config import ModelProbeConfig, read_model_config

pytest.importorskip("sklearn")

EMAILS = [
    ("Summarize the email.", "Hello team. The meeting moved to Friday. Bring the report."),
    ("What amount was paid?", "Your card was charged $20 by ACME. Reply if this is wrong."),
    ("Who sent the email?", "Hi, this is Dana from sales. Please find the price list below."),
    ("Find the date in the email.", "The invoice is due on 3 May. Thank you for your order."),
    ("List the action items.", "Please read the file. Then send the total to the company."),
    ("Translate the subject line.", "SUBJECT: team game|CONTENT: the game is at the city park."),
]


def write_rows(path: Path, labelled: bool) -> list[LabelledPair]:
    benign = [
        LabelledPair(f"e{i}", q, d, 0, task="email", group=f"email:{i}")
        for i, (q, d) in enumerate(EMAILS)
    ]
    rows = benign + make_injected_twins(benign, per_row=2, seed=1) if labelled else benign
    with path.open("w") as f:
        for r in rows:
            doc = {
                "id": r.id,
                "instruction": r.instruction,
                "data": r.data,
                "task": r.task,
                "source": r.group,
                "attack_category": r.attack_category,
                "position": r.position,
            }
            f.write(json.dumps({**doc, "label": r.label} if labelled else doc) + "\n")
    return rows


def engine_args(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--max-model-len", "2048", "--batch-size", "8"]


def test_subcommand_registry():
    assert {"calibrate", "evaluate", "split"} <= set(SUBCOMMANDS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate"])  # --data and --out are required


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("all", "all"), ("3", 3)])
def test_layer_budget_argument(value, parsed):
    args = build_parser().parse_args(["calibrate", "--data", "x", "--out", "o", "--layers", value])
    assert args.layers == parsed


def test_a_bad_layer_budget_says_what_is_accepted(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--data", "x", "--out", "o", "--layers", "0"])
    assert "expected auto, all or a number of layers >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_calibrate_then_evaluate_on_the_tiny_model(tiny_engine, tiny_llama_dir, tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", labelled=True)
    report = tmp_path / "report.json"
    code = main(
        [
            "calibrate",
            "--data",
            str(tmp_path / "rows.jsonl"),
            "--out",
            str(tmp_path / "cfg"),
            "--model-id",
            "tiny/llama",
            "--report",
            str(report),
            "--folds",
            "3",
            "--max-layers",
            "2",
            *engine_args(tiny_llama_dir),
        ],
        engine=tiny_engine,
    )
    assert code == 0
    config = read_model_config(tmp_path / "cfg" / "llama.json")
    config.check_fits(4, 4)
    assert config.model_id == "tiny/llama" and config.threshold is not None
    assert config.calibration is not None
    assert config.calibration.num_examples == len(rows) == 18
    assert config.calibration.sha256 == pairs_sha256(rows)
    assert {"midpoint", "fpr@0.01", "fpr@0.02", "fpr@0.05"} <= set(config.calibration.thresholds)
    assert sorted(config.operating_points) == [0.01, 0.02, 0.05]
    data_tokens = [
        sum(b - a for a, b in tiny_engine.prepare((r.instruction, r.data)).data_spans) for r in rows
    ]
    assert config.calibration.max_data_tokens == max(data_tokens)
    doc = json.loads(report.read_text())
    assert set(doc["configs"]) == {"logistic", "mean_focus"} and doc["layer_sweep"]

    out = tmp_path / "eval"
    assert (
        main(
            [
                "evaluate",
                "--config",
                str(report),
                str(tmp_path / "cfg" / "llama.json"),
                "--data",
                str(tmp_path / "rows.jsonl"),
                "--out-dir",
                str(out),
                "--name",
                "d",
                *engine_args(tiny_llama_dir),
            ],
            engine=tiny_engine,
        )
        == 0
    )
    result = json.loads((out / "d.json").read_text())
    assert (out / "d.md").read_text().startswith("# ")
    assert (out / "roc_d.png").stat().st_size > 5000 and (out / "layers_d.png").exists()
    assert {"keyword baseline", "data length (tokens)"} <= set(result["detectors"])
    # the reported AUROC is the one the config computes on the probe's own head scores
    pairs, _ = load_pairs(tmp_path / "rows.jsonl")
    table, skipped = score_pairs(tiny_engine, pairs)
    assert not skipped
    risk = [1 - config.focus(dict(zip(table.heads, row, strict=True))) for row in table.values]
    from guardrail.offline.evaluation import auroc

    name = f"{config.probe} (llama)"
    assert result["detectors"][name]["overall"]["auroc"] == pytest.approx(
        auroc([p.label for p in pairs], risk), abs=1e-4
    )
    # measured at its own threshold and at each operating point it records, on these rows
    labels = np.array([p.label for p in pairs])
    for rate, threshold in config.operating_points.items():
        point = result["operating_points"][f"{name}, target_fpr {rate:g}"]
        flagged = 1 - np.array(risk) <= threshold
        assert point["threshold"] == threshold
        assert point["fpr"] == round(float(flagged[labels == 0].mean()), 4)
        assert point["tpr"] == round(float(flagged[labels == 1].mean()), 4)


@pytest.mark.timeout(900)
def test_calibrate_a_combined_probe_on_the_tiny_model(
    tiny_hidden_engine, tiny_llama_dir, tmp_path, capsys
):
    """Attention and hidden state in one sparse model, end to end: the rows are scored once
    through the serving probe (heads, whole hidden streams at the last prompt token and averaged
    over the data tokens), the written config reads the hidden state at both positions, and an
    engine serving it scores every row as the config computes offline."""
    rows = write_rows(tmp_path / "rows.jsonl", labelled=True)
    cache = tmp_path / "scores.npz"

    def calibrate(*hidden_layers: str, means: tuple[str, ...] = ("0", "1", "2")) -> list[str]:
        return [
            "calibrate",
            "--data",
            str(tmp_path / "rows.jsonl"),
            "--out",
            str(tmp_path / "cfg"),
            "--model-id",
            "tiny/llama",
            "--probe",
            "combined",
            "--hidden-layers",
            *hidden_layers,
            "--data-mean-layers",
            *means,
            "--scores-cache",
            str(cache),
            "--folds",
            "3",
            "--max-layers",
            "1",
            *engine_args(tiny_llama_dir),
        ]

    assert main(calibrate("0", "1", "2"), engine=tiny_hidden_engine) == 0
    config = read_model_config(tmp_path / "cfg" / "llama.json")
    assert config.probe == "logistic" and config.hidden and config.hidden_size == 128
    assert {p.position for p in config.hidden} == {"last", "data_mean"}
    assert config.calibration is not None and config.calibration.num_examples == len(rows)
    assert any(k.startswith("worst-source fpr@0.01") for k in config.calibration.thresholds)
    table = ScoreTable.load(cache)
    assert sorted(table.hidden) == [0, 1, 2] and table.hidden[0].shape == (len(rows), 128)
    assert sorted(table.data_mean) == [0, 1, 2] and table.data_mean[1].shape == (len(rows), 128)

    def terms(last: Any, mean: Any) -> dict[int, float]:
        out: dict[int, float] = {}
        for p in config.hidden:
            stream = last[p.layer] if p.position == "last" else mean[p.layer]
            out[p.layer] = out.get(p.layer, 0.0) + p.project(stream)
        return out

    # the config's focus, computed offline from the cached heads and streams, is what the
    # serving probe gives the same rows
    column = {h: j for j, h in enumerate(table.heads)}
    want = []
    for i in range(len(rows)):
        heads = {h: table.values[i, column[h]] for h in config.heads}
        row = terms(
            {k: v[i] for k, v in table.hidden.items()},
            {k: v[i] for k, v in table.data_mean.items()},
        )
        want.append(config.focus(heads, row))
    served = tiny_hidden_engine.score([(r.instruction, r.data) for r in rows])
    for out in served:
        hidden = terms(out.probe.hidden_states, out.probe.data_mean_states)
        got = config.focus(out.probe.head_stats, hidden)
        assert got == pytest.approx(want[out.index], abs=1e-4)
    # the same cache asked for other hidden layers is refused with the fix
    # re-thresholding the combined config on the user's clean rows reads the hidden layers it
    # needs (from the cache here): the new threshold flags at most the target share of them
    out = tmp_path / "mine.json"
    threshold = ["threshold", "--config", str(tmp_path / "cfg" / "llama.json"), "--out", str(out)]
    data = ["--data", str(tmp_path / "rows.jsonl"), "--scores-cache", str(cache)]
    data += engine_args(tiny_llama_dir)
    assert main([*threshold, *data, "--target-fpr", "0.2"], engine=None) == 0
    clean = np.array([want[i] for i, r in enumerate(rows) if r.label == 0])
    assert np.mean(clean <= read_model_config(out).threshold) <= 0.2
    # the same cache asked for a hidden layer it lacks is refused with the fix
    capsys.readouterr()
    assert main(calibrate("3"), engine=tiny_hidden_engine) == 2
    assert "holds hidden states of layers [0, 1, 2], not the [3] asked" in capsys.readouterr().err


class StopsAfter:
    """The real engine, interrupted (as by Ctrl-C) after ``calls`` score calls; counts rows."""

    def __init__(self, engine, calls: int | None = None):
        self.engine, self.calls, self.rows = engine, calls, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def score(self, requests):
        if self.calls is not None:
            if self.calls == 0:
                raise KeyboardInterrupt
            self.calls -= 1
        self.rows += len(requests)
        return self.engine.score(requests)


def test_a_stopped_scoring_run_resumes_from_the_cache(tiny_engine, tmp_path):
    from guardrail.offline.row_scores import ScoringSettings, scores_for

    pairs = write_rows(tmp_path / "rows.jsonl", labelled=True)  # 18 rows
    cache = tmp_path / "scores.npz"
    settings = ScoringSettings(scores_cache=cache, batch_size=4)
    with pytest.raises(KeyboardInterrupt):
        scores_for(pairs, "tiny", "all", settings, StopsAfter(tiny_engine, calls=2))
    assert len(ScoreTable.load(cache).keys) == 8  # both batches scored, saved when it stopped
    resumed = StopsAfter(tiny_engine)
    kept, table, skipped, _ = scores_for(pairs, "tiny", "all", settings, resumed)
    assert resumed.rows == 10 and not skipped and len(kept) == 18
    reference, _ = score_pairs(tiny_engine, kept)  # one uninterrupted pass
    np.testing.assert_allclose(table.values, reference.values, atol=1e-5)


def test_threshold_is_re_set_on_clean_rows_of_the_users_traffic(
    tiny_engine, tiny_llama_dir, tmp_path, capsys
):
    from guardrail.offline.calibration import threshold_at_fpr

    rows = write_rows(tmp_path / "mine.jsonl", labelled=True)  # 6 clean, 12 injected
    config = ModelProbeConfig(model_id="tiny/llama", heads=[(0, 0), (1, 1)], threshold=0.99)
    (tmp_path / "cfg.json").write_text(config.model_dump_json())
    out = tmp_path / "mine" / "cfg.json"
    args = ["threshold", "--config", str(tmp_path / "cfg.json"), "--out", str(out)]
    data = ["--data", str(tmp_path / "mine.jsonl"), *engine_args(tiny_llama_dir)]
    assert main([*args, *data, "--target-fpr", "0.2"], engine=tiny_engine) == 0
    new = read_model_config(out)
    # independent reference: the clean rows' focus from the probe's own head scores
    clean = [r for r in rows if r.label == 0]
    table, _ = score_pairs(tiny_engine, clean)
    focus = np.array([config.focus(dict(zip(table.heads, v, strict=True))) for v in table.values])
    expected = threshold_at_fpr(focus, np.zeros(len(focus), dtype=int), 0.2)
    assert new.threshold == pytest.approx(expected, abs=1e-6)
    assert np.mean(focus <= new.threshold) <= 0.2 and new.heads == config.heads
    assert new.calibration is not None and new.calibration.max_data_tokens == max(
        sum(b - a for a, b in tiny_engine.prepare((r.instruction, r.data)).data_spans)
        for r in clean
    )
    assert "6 clean rows" in capsys.readouterr().out
    # a shipped variant by name: the tiny model ships none, and the error says so before scoring
    named = ["threshold", "--config", "combined", "--out", str(tmp_path / "v.json"), *data]
    assert main(named, engine=tiny_engine) == 2
    assert "no shipped probe config variant 'combined'" in capsys.readouterr().err
    assert not (tmp_path / "v.json").exists()
    # rows without a clean one: a clear error, nothing written
    injected = tmp_path / "attacks.jsonl"
    lines = (tmp_path / "mine.jsonl").read_text().splitlines()
    injected.write_text("\n".join(x for x in lines if '"label": 1' in x) + "\n")
    bad = ["--data", str(injected), *engine_args(tiny_llama_dir)]
    args[-1] = str(tmp_path / "never.json")
    assert main([*args, *bad], engine=tiny_engine) == 2
    assert "no clean rows" in capsys.readouterr().err and not (tmp_path / "never.json").exists()


def test_calibrate_from_benign_pairs_alone(tiny_engine, tiny_llama_dir, tmp_path):
    write_rows(tmp_path / "benign.jsonl", labelled=False)
    cache = tmp_path / "scores.npz"
    args = [
        "calibrate",
        "--data",
        str(tmp_path / "benign.jsonl"),
        "--out",
        str(tmp_path),
        "--twins-per-row",
        "3",
        "--folds",
        "2",
        "--max-layers",
        "1",
        "--probe",
        "mean_focus",
        "--scores-cache",
        str(cache),
        *engine_args(tiny_llama_dir),
    ]

    assert main(args, engine=tiny_engine) == 0
    config = read_model_config(tmp_path / f"{tiny_llama_dir.name}.json")
    assert config.probe == "mean_focus" and config.weights is None
    assert config.calibration is not None and config.calibration.num_examples == 6 * 4
    assert "generated twins" in config.calibration.dataset
    # a second run reads every score from the cache: no engine is needed at all
    assert main(args, engine=None) == 0


def test_a_score_cache_of_focus_only_is_refused_with_the_fix(tmp_path, capsys):
    # caches written before the probe read attention stats hold [rows, heads] focus
    cache = tmp_path / "old.npz"
    np.savez_compressed(
        cache,
        model=np.array("m"),
        heads=np.array([[0, 0]]),
        keys=np.array(["k"]),
        values=np.array([[0.5]]),
        prompt_tokens=np.array([10]),
        data_tokens=np.array([4]),
    )
    write_rows(tmp_path / "rows.jsonl", labelled=True)
    args = ["calibrate", "--data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path)]
    assert main([*args, "--scores-cache", str(cache)], engine=None) == 2
    err = capsys.readouterr().err
    assert "older version" in err and "delete it" in err and str(cache) in err


def test_calibrate_reports_missing_classes(tiny_engine, tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "clean.jsonl"
    path.write_text(json.dumps({"instruction": "Sum up.", "data": "Text.", "label": 0}) + "\n")
    code = main(
        ["calibrate", "--data", str(path), "--out", str(tmp_path), *engine_args(tiny_llama_dir)],
        engine=tiny_engine,
    )
    assert code == 2 and "clean and injected rows" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_console_entry_starts_its_own_engine(tiny_llama_dir, tmp_path):
    write_rows(tmp_path / "rows.jsonl", labelled=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "guardrail.cli",
            "calibrate",
            "--data",
            str(tmp_path / "rows.jsonl"),
            "--out",
            str(tmp_path),
            "--folds",
            "2",
            "--max-layers",
            "1",
            *engine_args(tiny_llama_dir),
        ],
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_model_config(tmp_path / f"{tiny_llama_dir.name}.json").calibration is not None
    # the scoring engine's placeholder config is no guard's: no "calibrate it" warning
    assert "never calibrated" not in proc.stderr + proc.stdout


# -- data layer --------------------------------------------------------------------------------


def test_load_pairs_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "data": "b", "label": 0}\n{"instruction": "a"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: field 'data' must be a string"):
        load_pairs(path)
    path.write_text('{"instruction": "a", "data": "b", "label": 2}\n')
    with pytest.raises(ConfigError, match=r"must be 0 \(clean\) or 1"):
        load_pairs(path)
    path.write_text(
        '{"instruction": "a", "data": "b", "label": 1}\n{"instruction": "c", "data": "d"}\n'
    )
    with pytest.raises(ConfigError, match="1 of 2 rows have no 'label'"):
        load_pairs(path)


def test_bipia_style_rows_group_by_source_context(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [
        {
            "id": f"r{i}",
            "task": "table",
            "source_index": i // 4,
            "instruction": "Q",
            "data": "d",
            "label": int(i % 4 > 0),
        }
        for i in range(40)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    pairs, labelled = load_pairs(path)
    assert labelled and pairs[5].group == "table:1"
    kept, held = split_by_group(pairs, 0.3, seed=2)
    assert len(held) == 12 and not {p.group for p in kept} & {p.group for p in held}
    assert all(sum(p.group == g for p in held) == 4 for g in {p.group for p in held})


def test_a_task_sample_does_not_depend_on_other_tasks_rows():
    from guardrail.offline.datasets import sample_groups

    table = [LabelledPair(f"t{i}", "Q", "d", 0, task="table", group=f"t{i}") for i in range(50)]
    other = [LabelledPair(f"a{i}", "Q", "d", 0, task="api", group=f"a{i}") for i in range(9)]
    alone = {p.group for p in sample_groups(table, 10, seed=3)}
    mixed = {p.group for p in sample_groups(other + table, 10, seed=3) if p.task == "table"}
    assert alone == mixed and len(alone) == 10
    assert alone != {p.group for p in sample_groups(table, 10, seed=4)}


def test_split_file_round_trip(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"task": t, "source_index": i, "instruction": "Q", "data": "d", "label": 0})
            for t in ("email", "code")
            for i in range(10)
        )
    )
    assert (
        main(
            [
                "split",
                "--data",
                str(path),
                "--held-out",
                "0.5",
                "--max-held-out-groups",
                "3",
                "--out",
                str(tmp_path / "split.json"),
            ]
        )
        == 0
    )
    held = read_split(tmp_path / "split.json")
    assert len(held) == 6 and {g.split(":")[0] for g in held} == {"email", "code"}


def test_injected_twins_and_insert_positions():
    base = LabelledPair("x", "Summarize.", "First sentence. Second one. Third here.", 0)
    twins = make_injected_twins([base], per_row=3, seed=0)
    assert [t.position for t in twins] == ["start", "middle", "end"]
    assert all(t.label == 1 and t.group == base.group and t.attack in t.data for t in twins)
    assert twins[0].data.startswith(twins[0].attack) and twins[2].data.endswith(twins[2].attack)
    assert insert_at("no boundary", "X", "middle") == "no bo X undary"
    assert len({t.attack for t in make_injected_twins([base] * 20, 1, seed=3)}) > 5
    with pytest.raises(ConfigError):
        insert_at("a", "b", "nowhere")


def test_pairs_hash_ignores_order_and_sees_content():
    a, b = LabelledPair("a", "i", "d", 0), LabelledPair("b", "i", "e", 1)
    assert pairs_sha256([a, b]) == pairs_sha256([b, a])
    assert pairs_sha256([a, b]) != pairs_sha256([a, LabelledPair("b", "i", "e", 0)])


# -- the shipped SmolLM2 config and its held-out split -----------------------------------------

REPO = Path(__file__).resolve().parents[2]
BIPIA = REPO.parent / "shared" / "data" / "bipia"
SPLIT = REPO / "docs" / "bipia_heldout_split.json"


def bipia_files() -> list[Path]:
    if not BIPIA.is_dir():
        pytest.skip("shared BIPIA data not beside the checkout")
    return [BIPIA / f"bipia_{task}_train_pairs.jsonl" for task in ("email", "code", "table")]


def bipia_rows() -> list[LabelledPair]:
    return load_pairs(bipia_files())[0]


SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_shipped_smollm2_configs_are_sparse_logistic_probes_with_worst_source_thresholds():
    """Both shipped SmolLM2 configs (the attention-only default, the combined variant) come
    from one calibration pool of six sources; each threshold is the lowest of the sources'
    1 %-FPR thresholds (so it flags at most 1 % of every source's clean rows, out of fold)."""
    from guardrail.probe.config import load_model_config

    default, combined = load_model_config(SMOLLM2), load_model_config(SMOLLM2, "combined")
    assert default.hidden is None and combined.hidden
    for config in (default, combined):
        config.check_fits(30, 9)
        assert config.probe == "logistic" and config.feature == "attention_stats"
        assert len(config.layers) <= 6
        cal = config.calibration
        assert cal is not None and cal.num_examples > 3000
        per_source = {k: v for k, v in cal.thresholds.items() if not k.startswith("worst")}
        assert len(per_source) == 6, cal.thresholds
        worst = cal.thresholds["worst-source fpr@0.01"]
        assert config.threshold == worst == min(per_source.values())
    assert default.calibration and combined.calibration
    assert default.calibration.sha256 == combined.calibration.sha256


def test_held_out_split_matches_the_data_and_is_disjoint_by_context():
    pairs = bipia_rows()
    doc = json.loads(SPLIT.read_text())
    held = read_split(SPLIT)
    held_rows = [p for p in pairs if p.group in held]
    assert pairs_sha256(held_rows) == doc["held_out_sha256"] and len(held_rows) == 400
    assert {len(v) for v in doc["held_out_groups"].values()} == {20, 60}


@pytest.mark.slow
def test_shipped_smollm2_configs_hash_is_their_calibration_pool(smollm2_dir):
    """The provenance the shipped SmolLM2 configs record is the installed pool (rows over 2,048
    prompt tokens skipped, as ``guardrail calibrate`` skips them without --data)."""
    from transformers import AutoTokenizer

    from guardrail.offline.layouts import request_for
    from guardrail.offline.pool import load_pool
    from guardrail.probe.config import load_model_config
    from guardrail.probe.prompts import prepare_prompt

    pool = load_pool()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prepared = [(r, prepare_prompt(request_for(r), tokenizer)) for r in pool]
    kept = [(r, prompt) for r, prompt in prepared if len(prompt.token_ids) <= 2048]
    data_tokens = max(sum(b - a for a, b in prompt.data_spans) for _, prompt in kept)
    for variant in (None, "combined"):
        cal = load_model_config(SMOLLM2, variant).calibration
        assert cal is not None
        assert cal.num_examples == len(kept) and cal.sha256 == pairs_sha256([r for r, _ in kept])
        assert cal.max_data_tokens == data_tokens


def test_evaluate_keeps_two_configs_with_the_same_file_name_apart(tmp_path):
    shipped = REPO / "model_configs" / "SmolLM2-135M-Instruct.json"
    doc = json.loads(shipped.read_text())
    paths = []
    for name, threshold in (("a", 0.1), ("b", 0.2)):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / shipped.name)
        paths[-1].write_text(json.dumps({**doc, "threshold": threshold}))
    configs, _ = load_detectors(paths)
    assert [c.threshold for c in configs.values()] == [0.1, 0.2]
    assert list(configs)[1] == f"logistic (SmolLM2-135M-Instruct) [{paths[1]}]"
    with pytest.raises(ConfigError, match="given twice"):
        load_detectors([paths[0], paths[0], paths[0]])


def test_a_data_top_config_is_measured_through_an_engine_serving_it(tiny_llama_dir, tmp_path):
    """A config reading the data tokens' highest values (``data_top``) cannot be scored from a
    score table: ``guardrail threshold`` measures it through an engine serving it, and that
    engine's focus is Hugging Face's for the same rows (stats and terms recomputed there)."""
    from guardrail.offline.layouts import request_for
    from guardrail.offline.row_scores import ScoringSettings
    from guardrail.offline.served import served_focus
    from guardrail.probe.prompts import prepare_prompt
    from tests.engine.test_hidden_state import expected_terms, hf_streams
    from tests.helpers import hf_head_stats, tiny_hidden_config

    config = tiny_hidden_config()
    assert config.hidden_layers_at("data_top")
    pairs = write_rows(tmp_path / "rows.jsonl", labelled=True)[:6]
    settings = ScoringSettings(max_model_len=2048, batch_size=4)
    focus = served_focus(pairs, str(tiny_llama_dir), config, settings)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    for pair, got in zip(pairs, focus, strict=True):
        p = prepare_prompt(request_for(pair), tokenizer)
        spans = tuple(tuple(s) for s in p.data_spans)
        terms = expected_terms(config, *hf_streams(str(tiny_llama_dir), tuple(p.token_ids), spans))
        stats = hf_head_stats(
            str(tiny_llama_dir), p.token_ids, p.instruction_spans, p.data_spans, config.heads
        )
        assert got == pytest.approx(config.focus(stats, terms), abs=5e-5)

    path = tmp_path / "top.json"
    path.write_text(config.model_dump_json())
    out = tmp_path / "rethresholded.json"
    args = ["threshold", "--config", str(path), "--data", str(tmp_path / "rows.jsonl")]
    assert main([*args, "--out", str(out), *engine_args(tiny_llama_dir)], engine=None) == 0
    assert read_model_config(out).hidden == config.hidden  # the read-outs kept, re-thresholded
