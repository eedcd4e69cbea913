"""The data tokens' mean stream as the serving probe reads it: does it make the combined probe
transfer, measured on the engine's own numbers?

Every row of the transfer benchmark (the packaged pool; the hand-written requests in five
layouts, AgentDojo tool outputs and, with ``--bipia-dir``, the held-out BIPIA split, which no
fit or choice here sees) is scored through the serving probe of the embedded SmolLM2 (the
score cache of ``benchmarks/detection_transfer.py`` serves: same rows, same streams), and the
combined probe is fitted three ways by the library's transfer evaluation
(:mod:`guardrail.offline.transfer_eval`):

- ``last``: attention stats + the last-token stream of layers 15 and 18;
- ``last+data_mean``: the same plus layer 15's stream averaged over the data tokens (the
  combined config ``guardrail calibrate`` ships);
- ``data_mean``: attention stats + the data-mean stream only.

Layer 15 for the mean was fixed before these runs (the offline study's layer, also the first
of the CV-chosen layers). Parity: with ``--states`` (the Hugging Face streams
``benchmarks/detection_delta.py`` extracts), the served data-mean stream of layer 15 against
Hugging Face's on the same token ids. The shipped config is written by ``guardrail calibrate
--out model_configs``, not here.

    python benchmarks/detection_data_mean.py --cache scores.npz [--states states.npz]

Writes benchmarks/results/data_mean_smollm2.{json,md} and docs/img/data_mean_<set>.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.embedded import EMBEDDED_MODEL_ID, model_or_embedded
from guardrail.offline.evaluation import markdown_table, plot_roc
from guardrail.offline.transfer import ScoredPool, recipe_for
from guardrail.offline.transfer_eval import (
    TransferResult,
    evaluate_transfer,
    score_rows,
    summary,
    test_sets,
    transfer_rows,
)
from guardrail.probe.config import load_model_config

ROOT = Path(__file__).resolve().parents[1]
LAST_LAYERS = (15, 18)
"""Last-token layers: the combined variant's (chosen by grouped CV on the pool)."""
DATA_MEAN_LAYERS = (15,)
VARIANTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "last": (LAST_LAYERS, ()),
    "last+data_mean": (LAST_LAYERS, DATA_MEAN_LAYERS),
    "data_mean": ((), DATA_MEAN_LAYERS),
}
SHIPPED = "last+data_mean"


def parity(pool: ScoredPool, states_path: Path | None) -> dict[str, Any] | None:
    """Served data-mean (layer 15) against Hugging Face's, on the rows both hold."""
    if states_path is None or not states_path.exists():
        return None
    states = np.load(states_path)
    where = {str(k): i for i, k in enumerate(states["keys"])}
    rows = [(j, where[r.id]) for j, r in enumerate(pool.rows) if r.id in where]
    served = pool.table.data_mean[15][[j for j, _ in rows]]
    hf = states["datamean_15"][[i for _, i in rows]]
    diff = np.abs(served.astype(np.float64) - hf)
    return {"rows": len(rows), "max_abs": float(diff.max()), "median_abs": float(np.median(diff))}


def cells(result: TransferResult, kind: str) -> dict[str, str]:
    return {
        source: f"{m['auroc']:.3f} / {m['flagged_clean']:.3f} / {m['caught']:.2f}"
        for source, m in summary(result)[kind].items()
    }


def markdown(results: dict[str, TransferResult], check: dict[str, Any] | None) -> str:
    check_text = (
        f"served vs Hugging Face data-mean stream of layer 15 on {check['rows']} rows: max abs "
        f"{check['max_abs']:.1e}, median {check['median_abs']:.1e}"
        if check
        else "no Hugging Face states given for the parity check"
    )
    rows = {variant: cells(result, "combined") for variant, result in results.items()}
    rows["attention-only default"] = cells(results["last"], "shipped")
    sources = list(rows["last"])
    out = [
        "# The data tokens' mean stream, served: smollm2\n",
        f"Every number from the serving probe ({check_text}). Cells: AUROC / clean rows flagged "
        "/ injections caught at the fit's threshold. `attention-only default` is the shipped "
        "config (fitted on the whole pool: its 'left out' cells are in-sample).\n",
        "## Combined probe, by hidden input\n\n" + markdown_table(rows, sources) + "\n",
    ]
    shipped = results[SHIPPED].kinds["combined"].tests
    layouts = sorted({lay for left in shipped.values() for lay in left.measured} - {"all"})
    per_layout = {
        source: {
            lay: f"{m['flagged_clean']} / {m['caught']}"
            for lay, m in left.measured.items()
            if lay != "all"
        }
        for source, left in shipped.items()
    }
    out.append(
        f"## Per prompt layout, {SHIPPED}: clean rows flagged / injections caught\n\n"
        + markdown_table(per_layout, layouts)
    )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="score cache (.npz)")
    parser.add_argument("--states", type=Path, help="Hugging Face streams for the parity check")
    parser.add_argument("--bipia-dir", type=Path, help="BIPIA's files: adds the held-out split")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    recipe = recipe_for(EMBEDDED_MODEL_ID, 30)
    split = ROOT / "docs" / "bipia_heldout_split.json"
    tests = test_sets(ROOT / "benchmarks" / "data", split, args.bipia_dir)
    pool = score_rows(
        transfer_rows(tests),
        model_or_embedded(None),
        recipe.hidden_candidates,
        args.cache,
        args.batch_size,
    )
    check = parity(pool, args.states)
    if check is not None and check["max_abs"] > 1e-2:
        raise SystemExit(f"served and Hugging Face data-mean streams differ: {check}")
    fixed = {"shipped": load_model_config(EMBEDDED_MODEL_ID)}
    attention = recipe.attention_layers or ()
    results = {
        variant: evaluate_transfer(pool, recipe, ("combined",), attention, last, means, fixed)
        for variant, (last, means) in VARIANTS.items()
    }
    for source in results[SHIPPED].kinds["combined"].tests:
        curves = {}
        for variant, result in results.items():
            left = result.kinds["combined"].tests[source]
            curves[variant] = (left.labels.tolist(), (1 - left.focus).tolist())
        plot_roc(curves, args.img / f"data_mean_{source}.png", f"{source}: combined, served")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "last_layers": list(LAST_LAYERS),
        "data_mean_layers": list(DATA_MEAN_LAYERS),
        "parity": check,
        "results": {variant: summary(result) for variant, result in results.items()},
    }
    (args.out / "data_mean_smollm2.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "data_mean_smollm2.md").write_text(markdown(results, check))
    print((args.out / "data_mean_smollm2.md").read_text())


if __name__ == "__main__":
    main()
