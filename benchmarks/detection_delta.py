"""Other positions' streams on SmolLM2: does the TaskTracker-style delta (the change of the
residual stream across the untrusted data) or the data's own mean stream add to the combined
probe?

TaskTracker (Abdelnabi et al.) reads the stream twice: at the end of what the model read before
the data (the "primary task") and at the last token after it, and classifies the difference.
Here, on the rows and prompt layouts of ``detection_transfer.py``, the hidden part of the probe
reads one of:

- ``last``: the stream at the last prompt token (what the shipped combined config reads);
- ``delta``: last minus the stream at the anchor, the token just before the first data segment
  (the end of the instruction and the template tokens that open the data);
- ``delta_instruction``: last minus the stream at the last instruction token before the data;
- ``last+delta``: both, in one sparse model;
- ``data_mean`` and ``last+data_mean``: the mean stream over the data tokens (a different
  question: does reading the data's own positions, as a classifier of the data would, help?).

Everything else is the transfer benchmark's: same calibration pool, layers 15 and 18, attention
stats of the same heads, same fits, same thresholds, leave-one-source-out and the held-out sets.

The serving probe reads the stream at the last prompt token and the data tokens' mean stream
(guardrail/worker/hidden.py), never the anchors, so this script gets every stream from Hugging
Face (eager attention, float32) on the very token ids the engine scores (``prepare_prompt``),
and checks its last-token stream against the serving probe's cached one (printed: max abs
difference). About 45 min on 2 cores for the ~4,300 rows (cached in
``--states``). Reads the transfer benchmark's score cache; fits and measures are the library's
(:mod:`guardrail.offline.transfer_eval`):

    python benchmarks/detection_delta.py --cache scores.npz --states states.npz \\
        [--bipia-dir ../shared/data/bipia]

Writes benchmarks/results/delta_smollm2.json and .md (docs/detection.md quotes them) and the
combined probe's ROC curves per held-out set, one per variant (docs/img/delta_<set>.png).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.embedded import EMBEDDED_MODEL_ID, model_or_embedded
from guardrail.offline.evaluation import markdown_table
from guardrail.offline.transfer import FitKind, ScoredPool, recipe_for
from guardrail.offline.transfer_eval import (
    evaluate_transfer,
    score_rows,
    summary,
    test_sets,
    transfer_rows,
)

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [15, 18]
"""The layers the transfer benchmark chose on the calibration pool (transfer_smollm2.json)."""
DATA_MEAN_LAYERS = [15]
"""Layers whose stream is averaged over the data tokens (``data_mean``)."""
VARIANTS = ("last", "delta", "delta_instruction", "last+delta", "data_mean", "last+data_mean")
KINDS: tuple[FitKind, ...] = ("hidden", "combined")


def anchors(prepared: Any) -> tuple[int, int]:
    """(token before the first data span, last instruction token before it)."""
    first = prepared.data_spans[0][0]
    before = [hi for _, hi in prepared.instruction_spans if hi <= first]
    return first - 1, (before[-1] - 1) if before else first - 1


def extract(rows: list[Any], table: Any, out: Path) -> None:
    """The stream at both anchors and at the last token of every row, with HF eager."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from guardrail.embedded import embedded_model_path
    from guardrail.offline.layouts import request_for
    from guardrail.probe.prompts import prepare_prompt

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    base = model.model
    # nothing above is read; HF applies the final norm to its last layer's output, so one more
    base.layers = base.layers[: max(LAYERS) + 2]
    streams: dict[str, list[np.ndarray]] = {f"datamean_{lay}": [] for lay in DATA_MEAN_LAYERS}
    streams |= {f"{what}_{layer}": [] for what in ("anchor", "anchori", "last") for layer in LAYERS}
    worst = 0.0
    for i, row in enumerate(tqdm(rows, desc="HF streams", unit="row")):
        prepared = prepare_prompt(request_for(row), tokenizer)
        anchor, instruction = anchors(prepared)
        with torch.no_grad():
            hidden = base(torch.tensor([prepared.token_ids]), output_hidden_states=True)
        for layer in LAYERS:
            h = hidden.hidden_states[layer + 1][0]  # [0] is the embeddings
            streams[f"anchor_{layer}"].append(h[anchor].numpy())
            streams[f"anchori_{layer}"].append(h[instruction].numpy())
            streams[f"last_{layer}"].append(h[-1].numpy())
        for layer in DATA_MEAN_LAYERS:
            h = hidden.hidden_states[layer + 1][0]
            data = torch.cat([h[lo:hi] for lo, hi in prepared.data_spans])
            streams[f"datamean_{layer}"].append(data.mean(0).numpy())
            worst = max(worst, float(np.abs(h[-1].numpy() - table.hidden[layer][i]).max()))
    print(f"last-token stream, HF vs the serving probe: max abs difference {worst:.2e}")
    if worst > 1e-2:  # streams of norm ~10: anything above float noise is a different stream
        raise SystemExit("HF's streams are not the serving probe's: nothing saved")
    arrays = {k: np.stack(v) for k, v in streams.items()}
    np.savez(out, keys=np.array([r.id for r in rows]), parity=np.array(worst), **arrays)


def hidden_for(variant: str, states: Any) -> dict[int, np.ndarray]:
    """The hidden part's inputs, keyed like layers (1000 + layer: a delta of that layer,
    2000 + layer: its mean over the data tokens)."""
    last = {layer: states[f"last_{layer}"] for layer in LAYERS}
    delta = {1000 + layer: last[layer] - states[f"anchor_{layer}"] for layer in LAYERS}
    delta_instruction = {1000 + lay: last[lay] - states[f"anchori_{lay}"] for lay in LAYERS}
    if variant.endswith("data_mean"):
        mean = {2000 + layer: states[f"datamean_{layer}"] for layer in DATA_MEAN_LAYERS}
        return {**last, **mean} if variant.startswith("last+") else mean
    return {
        "last": last,
        "delta": delta,
        "delta_instruction": delta_instruction,
        "last+delta": {**last, **delta},
    }[variant]


def markdown(results: dict[str, Any], parity: float) -> str:
    out = [
        "# The TaskTracker-style delta and the data's mean stream, smollm2\n",
        f"Hidden part: streams of layers {LAYERS} (last token, anchors), the mean over the data "
        f"tokens of layers {DATA_MEAN_LAYERS}; attention stats of the transfer benchmark's heads; "
        "same pool, fits and thresholds as transfer_smollm2.md. Streams from Hugging Face eager "
        f"on the engine's token ids (last-token stream vs the serving probe: max abs "
        f"{parity:.1e}). Cells: AUROC / share of clean rows flagged / share of injections "
        "caught at the fit's threshold.\n",
    ]
    for kind in KINDS:
        sources = list(results[VARIANTS[0]][kind])
        rows = {
            variant: {
                s: f"{m['auroc']:.3f} / {m['flagged_clean']:.3f} / {m['caught']:.2f}"
                for s, m in results[variant][kind].items()
            }
            for variant in VARIANTS
        }
        out.append(f"## {kind}\n\n" + markdown_table(rows, sources))
    return "\n".join(out)


def plot(curves: dict[str, dict[str, Any]], img: Path) -> None:
    """ROC of the combined probe per held-out set, one curve per variant (docs/img/delta_*.png)."""
    from guardrail.offline.evaluation import plot_roc

    for corpus in curves[VARIANTS[0]]:
        per_variant = {v: curves[v][corpus] for v in VARIANTS}
        plot_roc(per_variant, img / f"delta_{corpus}.png", f"{corpus}: combined probe, by variant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="score cache (.npz)")
    parser.add_argument("--states", type=Path, required=True, help="Hugging Face streams (.npz)")
    parser.add_argument("--bipia-dir", type=Path, help="BIPIA's files: adds the held-out split")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    recipe = recipe_for(EMBEDDED_MODEL_ID, 30)
    split = ROOT / "docs" / "bipia_heldout_split.json"
    rows = transfer_rows(test_sets(ROOT / "benchmarks" / "data", split, args.bipia_dir))
    pool = score_rows(rows, model_or_embedded(None), recipe.hidden_candidates, args.cache)
    if not args.states.exists():
        extract(pool.rows, pool.table, args.states)
    states = np.load(args.states)
    if list(states["keys"]) != [r.id for r in pool.rows]:
        raise SystemExit(f"{args.states} holds other rows: delete it to extract again")
    parity = float(states["parity"])
    results, curves = {}, {}
    for variant in VARIANTS:
        print(f"variant {variant}")
        hidden = hidden_for(variant, states)
        table = replace(pool.table, hidden=hidden, data_mean={})
        result = evaluate_transfer(
            ScoredPool(pool.rows, table),
            recipe,
            KINDS,
            recipe.attention_layers or (),
            sorted(hidden),
        )
        results[variant] = summary(result)
        curves[variant] = {
            source: (left.labels.tolist(), (1 - left.focus).tolist())
            for source, left in result.kinds["combined"].tests.items()
        }
    plot(curves, args.img)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"layers": LAYERS, "parity_max_abs": parity, "results": results}
    (args.out / "delta_smollm2.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "delta_smollm2.md").write_text(markdown(results, parity))
    print((args.out / "delta_smollm2.md").read_text())


if __name__ == "__main__":
    main()
