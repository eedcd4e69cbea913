"""A token-level read-out of the data's own streams, pooled over the data tokens: does it lift
the combined probe where the data's mean stream leaves it (docs/detection.md, "Where the limit
is")?

The shipped combined probe reads layer 15's stream averaged over the data tokens. A short
injection inside a long document is diluted in that mean. This script asks what a read-out made
for single tokens gives instead:

- a logistic model on layer 15's stream at *one data token*, fitted on the calibration pool's
  tokens: the tokens of each injected row's attack text (the pool's ``attack`` field, found in
  the rendered prompt) against the data tokens of clean rows, at most 48 of each per row;
- per request, the mean of its ``k`` highest token scores over the data tokens (k = 1: the
  maximum), one more column of the combined probe's L1 logistic fit.

The combined fits, thresholds and measures are the library's
(:func:`guardrail.offline.combined.fit_combined`, ``worst_source_threshold``,
:func:`guardrail.offline.transfer.measure`). The pool's pooled scores are out of fold: the
token model that scores a pool row was fitted on the other folds' groups
(``group_folds(groups, 5, 0)``, the folds the combined fit uses). The test sets are scored by the
token model fitted on the whole pool. The token model's C and the pooling's k are chosen by the
combined fit's grouped cross-validated AUROC on the pool alone. The test sets play no part.

Each variant is fitted on the same features: the attention stats of the shipped combined
config's 29 heads (the shipped fit chose them among the 45 heads of its layers), the last-token
streams of layers 15 and 18, and layer 15's data-mean stream. The ``refit`` row is that fit
without the token read-out, so its distance to ``shipped`` is what the narrower head set costs.

Every stream comes from Hugging Face (eager attention, float32) on the very token ids the engine
scores (``prepare_prompt``). The shipped config's focus computed from these features is reported
next to the engine's figures (docs/detection.md) as the check that they are the serving probe's.
About 55 min on 2 cores for the ~4,300 rows; cached in ``--states``:

    python benchmarks/detection_token_readout.py --states token_states.npz \\
        --bipia-dir ../shared/data/bipia

Writes benchmarks/results/token_readout_smollm2.{json,md} and docs/img/token_readout_<set>.png.
This is the offline study (Hugging Face features, one random draw of tokens across rows, the
pool's own token standardisation). ``guardrail calibrate`` now fits the served read-out itself
from the engine's streams (:mod:`guardrail.offline.token_fit`), with per-row seeded draws, so
its numbers differ a little from these; docs/detection.md has both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from guardrail.embedded import model_or_embedded
from guardrail.offline.calibration import group_folds
from guardrail.offline.combined import (
    combined_focus,
    fit_combined,
    worst_source_threshold,
)
from guardrail.offline.datasets import LabelledPair
from guardrail.offline.evaluation import markdown_table, plot_roc
from guardrail.offline.layouts import request_for
from guardrail.offline.transfer import measure
from guardrail.offline.transfer_eval import test_sets, transfer_rows
from guardrail.probe.config import ModelProbeConfig, read_model_config
from guardrail.probe.prompts import prepare_prompt
from guardrail.probe.scoring import HeadKey

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "model_configs" / "SmolLM2-135M-Instruct.combined.json"
LAST_LAYERS = (15, 18)
DATA_LAYER = 15
TOKENS_PER_ROW = 48
FOLDS = 5
C_GRID = (0.01, 0.05, 0.2)
K_GRID = (1, 3, 5, 10, 20)
"""k tried. The first run tried (1, 3, 5) and the pool's optimum sat at 5, the grid's edge, so
10 and 20 were added (the pool's CV chose 10); docs/detection.md reports the second run."""
POOLED = 10_000
"""The pooled token score enters ``fit_combined`` as a one-column "last" stream of this
pseudo-layer (after the real layers in column order); only its weight is read back."""


# -- features ------------------------------------------------------------------------------------
def _attention_row_stats(attention: np.ndarray, instruction: np.ndarray, data: np.ndarray) -> list:
    """:data:`guardrail.probe.scoring.ATTENTION_STATS` of one head's last-token attention row."""
    on_data = attention[data]
    mass = on_data.sum()
    share = on_data / (mass + 1e-8)
    entropy = -(share * np.log(share + 1e-12)).sum() / np.log(max(len(on_data), 2))
    return [attention[instruction].sum(), mass, attention[0], on_data.max(), entropy]


def extract(rows: list[LabelledPair], config: ModelProbeConfig, model_dir: str) -> dict[str, Any]:
    """Per row, from Hugging Face: the config's head stats, the last-token streams of
    :data:`LAST_LAYERS` and the data tokens' streams of :data:`DATA_LAYER` (float16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    full = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model = full.eval().model
    heads: list[HeadKey] = [(int(h[0]), int(h[1])) for h in config.heads]
    deepest = max([*LAST_LAYERS, DATA_LAYER, *(layer for layer, _ in heads)])
    model.layers = model.layers[: deepest + 1]  # no layer after the deepest read runs
    caught: dict[int, torch.Tensor] = {}
    for layer in sorted({layer for layer, _ in heads}):
        model.layers[layer].self_attn.register_forward_hook(
            lambda m, a, out, layer=layer: caught.__setitem__(layer, out[1][0, :, -1, :])
        )
    out: dict[str, Any] = {"ids": [], "stats": [], "tokens": [0]}
    out.update({f"last{layer}": [] for layer in LAST_LAYERS})
    data_streams = []
    for row in tqdm(rows, desc="Hugging Face streams", mininterval=10):
        prepared = prepare_prompt(request_for(row), tokenizer)
        ids = torch.tensor([prepared.token_ids])
        with torch.no_grad():
            streams = model(ids, output_hidden_states=True).hidden_states
        n = len(prepared.token_ids)
        instruction, data = np.zeros(n, bool), np.zeros(n, bool)
        for a, b in prepared.instruction_spans:
            instruction[a:b] = True
        for a, b in prepared.data_spans:
            data[a:b] = True
        out["ids"].append(row.id)
        out["stats"].append(
            [
                _attention_row_stats(caught[layer][head].double().numpy(), instruction, data)
                for layer, head in heads
            ]
        )
        for layer in LAST_LAYERS:  # hidden_states[i + 1]: decoder layer i's output, un-normed
            out[f"last{layer}"].append(streams[layer + 1][0, -1].numpy())
        data_index = np.concatenate([np.arange(a, b) for a, b in prepared.data_spans])
        data_streams.append(streams[DATA_LAYER + 1][0, data_index].numpy().astype(np.float16))
        out["tokens"].append(out["tokens"][-1] + len(data_index))
    return {
        "ids": np.array(out["ids"]),
        "stats": np.array(out["stats"]),
        **{f"last{layer}": np.stack(out[f"last{layer}"]) for layer in LAST_LAYERS},
        "data": np.concatenate(data_streams),
        "tokens": np.array(out["tokens"]),
    }


def attack_mask(row: LabelledPair, tokenizer: Any) -> np.ndarray | None:
    """Which data tokens of an injected row belong to its attack text: None when the row is
    clean, has no attack text, or the text is not found verbatim in the rendered prompt (a
    layout that escapes it), or the prompt's tokens do not re-tokenize to the same ids."""
    if not row.label or not row.attack:
        return None
    prepared = prepare_prompt(request_for(row), tokenizer)
    at = prepared.text.find(row.attack)
    if at < 0:
        return None
    encoded = tokenizer(prepared.text, add_special_tokens=False, return_offsets_mapping=True)
    if encoded["input_ids"] != prepared.token_ids:
        return None
    offsets = np.array(encoded["offset_mapping"])
    data_index = np.concatenate([np.arange(a, b) for a, b in prepared.data_spans])
    start, end = offsets[data_index, 0], offsets[data_index, 1]
    return (end > at) & (start < at + len(row.attack))


# -- the token model -----------------------------------------------------------------------------
class TokenStreams:
    """The data tokens' streams of every row, standardised on the pool's tokens."""

    def __init__(self, states: Any, pool: np.ndarray) -> None:
        self.data, self.tokens = states["data"], states["tokens"]
        sample = np.concatenate([self.row(i) for i in pool])
        self.mean, self.std = sample.mean(0), sample.std(0) + 1e-6

    def row(self, i: int) -> np.ndarray:
        return self.data[self.tokens[i] : self.tokens[i + 1]].astype(np.float32)

    def z(self, i: int) -> np.ndarray:
        return (self.row(i) - self.mean) / self.std


def fit_token_model(
    streams: TokenStreams, rows: np.ndarray, labels: np.ndarray, masks: list, c: float
) -> Any:
    """L2 logistic on single data tokens of ``rows``: attack tokens against clean rows' data
    tokens, at most :data:`TOKENS_PER_ROW` of each per row (a fixed random draw)."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x, y = [], []
    for i in rows:
        tokens = streams.z(i)
        if labels[i] == 0:
            pick = rng.permutation(len(tokens))[:TOKENS_PER_ROW]
        elif masks[i] is not None and masks[i].any():
            pick = rng.permutation(np.flatnonzero(masks[i]))[:TOKENS_PER_ROW]
        else:
            continue
        x.append(tokens[pick])
        y += [int(labels[i])] * len(pick)
    return LogisticRegression(C=c, max_iter=3000).fit(np.concatenate(x), np.array(y))


def pooled(model: Any, streams: TokenStreams, rows: np.ndarray, ks: tuple[int, ...]) -> np.ndarray:
    """Per row and k: the mean of its k highest token scores over the data tokens."""
    out = np.empty((len(rows), len(ks)))
    for r, i in enumerate(rows):
        scores = np.sort(model.decision_function(streams.z(i)))[::-1]
        out[r] = [scores[:k].mean() for k in ks]
    return out


# -- fits and measures ---------------------------------------------------------------------------
def shipped_focus(config: ModelProbeConfig, states: Any, streams: TokenStreams, i: int) -> float:
    """The shipped config's focus for row ``i``, from the Hugging Face features."""
    terms: dict[int, float] = {}
    for part in config.hidden or []:
        x = states[f"last{part.layer}"][i] if part.position == "last" else streams.row(i).mean(0)
        terms[part.layer] = terms.get(part.layer, 0.0) + part.project(x)
    return config.focus_of_stats(states["stats"][i], terms)


def fit_inputs(
    config: ModelProbeConfig,
    states: Any,
    streams: TokenStreams,
    rows: np.ndarray,
    extra: np.ndarray | None,
) -> tuple[np.ndarray, list[HeadKey], dict[int, np.ndarray], dict[int, np.ndarray]]:
    """What the combined fit reads for ``rows``: the heads' stats, the heads, the last-token
    streams (and the pooled token score as one more column when ``extra`` is given), the
    data-mean stream."""
    hidden = {layer: states[f"last{layer}"][rows] for layer in LAST_LAYERS}
    if extra is not None:
        hidden[POOLED] = extra[:, None]
    data_mean = {DATA_LAYER: np.stack([streams.row(i).mean(0) for i in rows])}
    heads: list[HeadKey] = [(int(h[0]), int(h[1])) for h in config.heads]
    return states["stats"][rows], heads, hidden, data_mean


def fit_variant(
    config: ModelProbeConfig,
    states: Any,
    streams: TokenStreams,
    rows: np.ndarray,
    labels: np.ndarray,
    groups: list[str],
    extra: np.ndarray | None,
) -> Any:
    """The combined fit on the pool's ``rows`` (:func:`fit_inputs`)."""
    stats, heads, hidden, data_mean = fit_inputs(config, states, streams, rows, extra)
    return fit_combined(
        stats, heads, hidden, labels[rows], groups, feature=config.feature, data_mean=data_mean
    )


def test_focus(
    config: ModelProbeConfig,
    fit: Any,
    states: Any,
    streams: TokenStreams,
    rows: np.ndarray,
    extra: np.ndarray | None,
) -> np.ndarray:
    """The focus ``fit`` gives ``rows`` (:func:`fit_inputs`)."""
    stats, heads, hidden, data_mean = fit_inputs(config, states, streams, rows, extra)
    return combined_focus(fit, stats, heads, hidden, data_mean)


COLUMNS = (
    "auroc",
    "tpr_at_1pct_fpr",
    "flagged_clean",
    "caught",
    "flagged_clean_2pct",
    "caught_2pct",
)


def markdown(doc: dict[str, Any]) -> str:
    out = [
        "# A token-level read-out pooled over the data tokens (SmolLM2-135M)\n",
        f"Chosen on the pool alone (grouped CV AUROC of the combined fit): C = {doc['chosen'][0]}, "
        f"k = {doc['chosen'][1]}. Thresholds: the worst calibration source's 1 % (2 %) "
        "out-of-fold false-positive rate.\n",
    ]
    for corpus in doc["sets"]:
        table = {v: r["sets"][corpus] for v, r in doc["variants"].items()}
        out.append(f"## {corpus}\n\n" + markdown_table(table, COLUMNS) + "\n")
    cv = {
        v: {"cv_auroc": r.get("cv_auroc"), "threshold": r.get("threshold")}
        for v, r in doc["variants"].items()
    }
    out.append("## The fits\n\n" + markdown_table(cv, ["cv_auroc", "threshold"]) + "\n")
    left = {
        source: {
            f"{name} {what}": value
            for name, values in row.items()
            for what, value in zip(("auroc", "flagged", "caught"), values, strict=True)
        }
        for source, row in doc["left_out"].items()
    }
    columns = [f"{n} {w}" for n in ("refit", "token") for w in ("auroc", "flagged", "caught")]
    out.append(
        "## Each calibration source left out (chosen C and k; the fit's own 1 % threshold)\n\n"
        + markdown_table(left, columns)
        + "\n"
    )
    return "\n".join(out)


def leave_one_source_out(
    config: ModelProbeConfig,
    states: Any,
    streams: TokenStreams,
    pool: np.ndarray,
    labels: np.ndarray,
    masks: list,
    corpus: np.ndarray,
    groups: np.ndarray,
    c: float,
    k: int,
) -> dict[str, dict[str, Any]]:
    """Each calibration source left out: the combined fit without and with the token read-out
    (token models and folds on the other sources only), measured on the source left out at
    the fit's own 1 % worst-source threshold."""
    out: dict[str, dict[str, Any]] = {}
    for source in tqdm(sorted(set(corpus[pool])), desc="sources left out"):
        train, held = pool[corpus[pool] != source], pool[corpus[pool] == source]
        train_groups = [str(g) for g in groups[train]]
        folds = group_folds(train_groups, FOLDS, 0)
        oof = np.empty(len(train))
        for fold in np.unique(folds):
            model = fit_token_model(streams, train[folds != fold], labels, masks, c)
            oof[folds == fold] = pooled(model, streams, train[folds == fold], (k,))[:, 0]
        on_held = pooled(fit_token_model(streams, train, labels, masks, c), streams, held, (k,))
        row: dict[str, Any] = {}
        for name, extra in (("refit", None), ("token", (oof, on_held[:, 0]))):
            fit = fit_variant(
                config,
                states,
                streams,
                train,
                labels,
                train_groups,
                None if extra is None else extra[0],
            )
            threshold = worst_source_threshold(
                fit.oof_focus, labels[train], list(corpus[train]), 0.01
            )[0]
            focus = test_focus(
                config, fit, states, streams, held, None if extra is None else extra[1]
            )
            m = measure(labels[held], focus, threshold)
            row[name] = (m["auroc"], m["flagged_clean"], m["caught"])
        out[source] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--states", type=Path, required=True, help="Hugging Face streams (.npz)")
    parser.add_argument("--bipia-dir", type=Path, help="BIPIA's files: adds the held-out split")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    config = read_model_config(CONFIG)
    model_dir = model_or_embedded(None)
    split = ROOT / "docs" / "bipia_heldout_split.json"
    rows = transfer_rows(test_sets(ROOT / "benchmarks" / "data", split, args.bipia_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [r for r in rows if len(prepare_prompt(request_for(r), tokenizer).token_ids) <= 2048]
    if not args.states.exists():
        np.savez(args.states, **extract(rows, config, model_dir))
    states = dict(np.load(args.states))
    if list(states["ids"]) != [r.id for r in rows]:
        raise SystemExit(f"{args.states} holds other rows: delete it to extract again")
    labels = np.array([r.label for r in rows])
    role = np.array([r.extra.get("role") for r in rows])
    corpus = np.array([r.extra.get("corpus") for r in rows])
    pool, test = np.flatnonzero(role == "calibration"), np.flatnonzero(role == "test")
    groups = [rows[i].group for i in pool]
    folds = group_folds(groups, FOLDS, 0)
    masks = [attack_mask(r, tokenizer) for r in rows]
    streams = TokenStreams(states, pool)
    with_mask = sum(masks[i] is not None for i in pool if labels[i])
    print(f"pool: {len(pool)} rows, {with_mask} of {int(labels[pool].sum())} injected with tokens")

    extras: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for c in tqdm(C_GRID, desc="token models"):
        oof = np.empty((len(pool), len(K_GRID)))
        for fold in np.unique(folds):
            model = fit_token_model(streams, pool[folds != fold], labels, masks, c)
            oof[folds == fold] = pooled(model, streams, pool[folds == fold], K_GRID)
        on_test = pooled(fit_token_model(streams, pool, labels, masks, c), streams, test, K_GRID)
        for j, k in enumerate(K_GRID):
            extras[f"token C={c} k={k}"] = (oof[:, j], on_test[:, j])
    variants: dict[str, dict[str, Any]] = {}
    focus = {"shipped": np.array([shipped_focus(config, states, streams, i) for i in test])}
    assert config.threshold is not None
    thresholds: dict[str, tuple[float, float | None]] = {"shipped": (config.threshold, None)}
    fits: dict[str, Any] = {}
    for name, extra in tqdm([("refit", None), *extras.items()], desc="combined fits"):
        fit = fit_variant(
            config, states, streams, pool, labels, groups, None if extra is None else extra[0]
        )
        fits[name] = fit
        sources = list(corpus[pool])
        one, two = (
            worst_source_threshold(fit.oof_focus, labels[pool], sources, fpr)[0]
            for fpr in (0.01, 0.02)
        )
        thresholds[name] = (one, two)
        focus[name] = test_focus(
            config, fit, states, streams, test, None if extra is None else extra[1]
        )
    chosen = max((n for n in fits if n != "refit"), key=lambda n: fits[n].cv_auroc)
    chosen_c, chosen_k = float(chosen.split("C=")[1].split()[0]), int(chosen.split("k=")[1])
    row_groups = np.array([r.group for r in rows])
    left_out = leave_one_source_out(
        config, states, streams, pool, labels, masks, corpus, row_groups, chosen_c, chosen_k
    )
    sets = sorted(set(corpus[test]))
    for name in ["shipped", "refit", chosen, *(n for n in fits if n not in ("refit", chosen))]:
        at_1, at_2 = thresholds[name]
        per_set = {}
        for s in sets:
            sel = corpus[test] == s
            m = dict(measure(labels[test][sel], focus[name][sel], at_1))
            if at_2 is not None:
                m2 = measure(labels[test][sel], focus[name][sel], at_2)
                m["flagged_clean_2pct"], m["caught_2pct"] = m2["flagged_clean"], m2["caught"]
            per_set[s] = m
        fit = fits.get(name)
        variants[name] = {
            "threshold": round(at_1, 5),
            "cv_auroc": None if fit is None else round(fit.cv_auroc, 4),
            "sets": per_set,
        }
    doc = {
        "chosen": [chosen_c, chosen_k],
        "left_out": left_out,
        "sets": sets,
        "pool_rows": len(pool),
        "test_rows": len(test),
        "variants": variants,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "token_readout_smollm2.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "token_readout_smollm2.md").write_text(markdown(doc))
    for s in sets:
        sel = corpus[test] == s
        curves = {
            n: (labels[test][sel].tolist(), (1 - focus[n][sel]).tolist())
            for n in ("shipped", "refit", chosen)
        }
        title = f"{s}: combined probe, with and without the token read-out"
        plot_roc(curves, args.img / f"token_readout_{s}.png", title)
    print((args.out / "token_readout_smollm2.md").read_text())


if __name__ == "__main__":
    main()
