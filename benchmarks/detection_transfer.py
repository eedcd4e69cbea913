"""Detection that transfers: calibrate on the pool, measure on sources and layouts left out.

Every row (the packaged calibration pool, and the test sets: the hand-written requests in five
layouts, AgentDojo tool outputs, and with ``--bipia-dir`` the held-out BIPIA split) is scored
ONCE through the serving probe (every head; the last-token and data-mean streams of the
recipe's candidate layers; cached in ``--cache``), then the library fits and measures
(:mod:`guardrail.offline.transfer_eval`, the recipe of :mod:`guardrail.offline.transfer`):

- ``shipped``: the model's default config as it ships (fixed, nothing refitted);
- ``attention``, ``hidden``, ``combined``: fitted on the pool (last-token streams of the two
  layers a hidden-only probe ranks best on the pool); ``combined+data_mean`` adds the first
  chosen layer's data-mean stream (what ``guardrail calibrate`` ships as the combined config).

No fit, layer choice or threshold sees a test row; AgentDojo is reported as a seen set (it
informed the choice of the shipped read-out). The shipped configs themselves are written by
``guardrail calibrate --out model_configs`` (same recipe), not here. Writes
``<out>/transfer_<name>.json`` and ``.md`` and, for SmolLM2, ROC PNGs per test set and
left-out source into ``--img``.

    VLLM_CPU_OMP_THREADS_BIND=0-1 python benchmarks/detection_transfer.py \\
        --cache benchmarks/results/scores/transfer_smollm2.npz --bipia-dir ../shared/data/bipia
    python benchmarks/detection_transfer.py --model ~/.cache/vllm-guardrail/tests/tiny-llama \\
        --cache tiny.npz                                     # the random-weight control
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from guardrail.embedded import EMBEDDED_MODEL_ID, model_or_embedded
from guardrail.offline.evaluation import markdown_table, plot_roc
from guardrail.offline.pool_fit import ModelShape
from guardrail.offline.transfer import (
    ScoredPool,
    TransferRecipe,
    choose_attention_layers,
    choose_hidden_layers,
    recipe_for,
)
from guardrail.offline.transfer_eval import (
    TransferResult,
    evaluate_transfer,
    score_rows,
    test_sets,
    transfer_rows,
)
from guardrail.probe.config import load_model_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
SPLIT = ROOT / "docs" / "bipia_heldout_split.json"
METRICS = ("auroc", "tpr_at_1pct_fpr", "flagged_clean", "caught", "n_clean", "n_injected")


def evaluate(pool: ScoredPool, recipe: TransferRecipe, model_id: str) -> dict[str, Any]:
    """Both variants of the transfer table: last-token streams, then with the data mean."""
    attention = choose_attention_layers(pool, pool.calibration, recipe)
    last, layer_cv = choose_hidden_layers(pool, pool.calibration, recipe)
    fixed = {"shipped": load_model_config(model_id)} if model_id == EMBEDDED_MODEL_ID else {}
    last_only = evaluate_transfer(
        pool, recipe, ("attention", "hidden", "combined"), attention, last, (), fixed
    )
    with_mean = evaluate_transfer(pool, recipe, ("combined",), attention, last, last[:1])
    return {
        "attention_layers": list(attention),
        "hidden_layers": list(last),
        "hidden_layer_cv_auroc": {str(k): v for k, v in layer_cv.items()},
        "results": {"last": last_only, "last+data_mean": with_mean},
    }


def _merged(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{kind: KindResult-like} of both variants, the data-mean one as ``combined+data_mean``."""
    last: TransferResult = report["results"]["last"]
    mean: TransferResult = report["results"]["last+data_mean"]
    kinds = dict(last.kinds) | {"combined+data_mean": mean.kinds["combined"]}
    left = {
        s: dict(k) | {"combined+data_mean": mean.left_out[s]["combined"]}
        for s, k in last.left_out.items()
    }
    return {"kinds": kinds, "left_out": left}


def as_json(report: dict[str, Any]) -> dict[str, Any]:
    merged = _merged(report)
    return {
        **{k: v for k, v in report.items() if k != "results"},
        "thresholds": {k: round(v.threshold, 6) for k, v in merged["kinds"].items()},
        "tests": {
            k: {s: left.measured for s, left in v.tests.items()} for k, v in merged["kinds"].items()
        },
        "left_out": {
            s: {k: left.measured for k, left in per.items()}
            for s, per in merged["left_out"].items()
        },
    }


def markdown(report: dict[str, Any], name: str) -> str:
    merged = _merged(report)
    out = [
        f"# Detection transfer, {name}\n",
        f"Attention heads of layers {report['attention_layers']}; stream layers "
        f"{report['hidden_layers']} (ranked on the pool: {report['hidden_layer_cv_auroc']}). "
        "Fitted kinds flag at most 1 % of the clean rows of every calibration source.\n",
    ]
    tests = next(iter(merged["kinds"].values())).tests
    for source in tests:
        rows = {k: v.tests[source].measured["all"] for k, v in merged["kinds"].items()}
        out.append(f"## {source} (fitted on the pool)\n\n" + markdown_table(rows, METRICS) + "\n")
    for source, per_kind in merged["left_out"].items():
        rows = {k: left.measured["all"] for k, left in per_kind.items()}
        out.append(f"## {source} left out\n\n" + markdown_table(rows, METRICS) + "\n")
    out.append("## Per layout, combined+data_mean\n")
    for source, left in merged["kinds"]["combined+data_mean"].tests.items():
        rows = {k: v for k, v in left.measured.items() if k != "all"}
        out.append(f"### {source}\n\n" + markdown_table(rows, METRICS) + "\n")
    return "\n".join(out)


def plots(report: dict[str, Any], img: Path) -> None:
    """ROC curves of every kind per test set and per source left out (docs/detection.md)."""
    merged = _merged(report)
    for source in next(iter(merged["kinds"].values())).tests:
        curves = {
            kind: (r.tests[source].labels.tolist(), (1 - r.tests[source].focus).tolist())
            for kind, r in merged["kinds"].items()
        }
        plot_roc(curves, img / f"transfer_{source}.png", f"{source} (fitted on the pool)")
    for source, per_kind in merged["left_out"].items():
        curves = {k: (v.labels.tolist(), (1 - v.focus).tolist()) for k, v in per_kind.items()}
        plot_roc(curves, img / f"transfer_loso_{source}.png", f"{source} left out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="score cache (.npz)")
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--bipia-dir", type=Path, help="BIPIA's files: adds the held-out split")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--score-only", action="store_true", help="stop after scoring")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    model = model_or_embedded(args.model)
    model_id = EMBEDDED_MODEL_ID if args.model is None else Path(args.model).name
    name = "smollm2" if args.model is None else model_id
    recipe = recipe_for(model_id, ModelShape.of(model, model_id).num_layers)
    rows = transfer_rows(test_sets(DATA, SPLIT, args.bipia_dir))
    pool = score_rows(rows, model, recipe.hidden_candidates, args.cache, args.batch_size)
    if args.score_only:
        return
    report = evaluate(pool, recipe, model_id)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"transfer_{name}.json").write_text(json.dumps(as_json(report), indent=1) + "\n")
    (args.out / f"transfer_{name}.md").write_text(markdown(report, name))
    if args.model is None:
        plots(report, args.img)
    print(markdown(report, name))


if __name__ == "__main__":
    main()
