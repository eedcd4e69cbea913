"""The transfer evaluation: probe kinds fitted on the calibration pool, measured on test sets
and on each calibration source left out, next to fixed configs (e.g. one shipped before).

Rows: the packaged pool (role ``calibration``) and test sets (role ``test``), each row tagged
with its source (``extra["corpus"]``) and layout. :func:`transfer_rows` builds them from the
test files a caller has (the benchmark's hand-written requests, AgentDojo tool outputs and the
held-out BIPIA split live in the repository, not in the package). No fit, layer choice or
threshold ever sees a test row.

Example:
    >>> tests = {"handwritten": (Path("handwritten.jsonl"), ("pair",))}
    >>> rows = transfer_rows(tests)  # doctest: +SKIP
    >>> result = evaluate_transfer(ScoredPool(rows, table), recipe, ("attention", "combined"),
    ...                            (7, 14), (15, 18), (15,))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from guardrail.offline.datasets import LabelledPair, load_pairs, read_split
from guardrail.offline.layouts import with_drawn_layouts, with_layouts
from guardrail.offline.pool import load_pool, tag_corpus
from guardrail.offline.row_scores import ScoringSettings, config_focus, scores_for
from guardrail.offline.transfer import (
    FitKind,
    LeftOut,
    Measured,
    ProbeFit,
    ScoredPool,
    TransferRecipe,
    fit_probe,
    leave_one_source_out,
    per_layout,
    probe_focus,
)
from guardrail.probe.config import ModelProbeConfig

__all__ = [
    "TEST_LAYOUTS",
    "KindResult",
    "TransferResult",
    "evaluate_transfer",
    "score_rows",
    "summary",
    "test_sets",
    "transfer_rows",
]

TEST_LAYOUTS = ("pair", "user_message", "tool", "rag_system", "multi_segment")
"""Layouts the hand-written requests are measured in (AgentDojo's tool outputs: ``tool``)."""


def test_sets(
    data_dir: Path, split: Path, bipia_dir: Path | None = None
) -> dict[str, tuple[Sequence[LabelledPair] | Path, Sequence[str] | None]]:
    """The project's test sets for :func:`transfer_rows`: with ``bipia_dir`` (BIPIA's train
    pair files) its held-out split (the groups ``split`` names, ``pair`` layout), then the
    hand-written requests of ``data_dir`` (:data:`TEST_LAYOUTS`) and its AgentDojo tool outputs
    (``heldout/agentdojo_heldout.jsonl``, ``tool``)."""
    tests: dict[str, tuple[Sequence[LabelledPair] | Path, Sequence[str] | None]] = {}
    if bipia_dir is not None:
        held = read_split(split)
        files = [bipia_dir / f"bipia_{t}_train_pairs.jsonl" for t in ("email", "code", "table")]
        tests["bipia_heldout"] = ([p for p in load_pairs(files)[0] if p.group in held], None)
    tests["handwritten"] = (data_dir / "handwritten_requests.jsonl", TEST_LAYOUTS)
    tests["agentdojo"] = (data_dir / "heldout" / "agentdojo_heldout.jsonl", ("tool",))
    return tests


def score_rows(
    rows: Sequence[LabelledPair],
    model: str,
    layers: Sequence[int],
    cache: Path | None,
    batch_size: int = 32,
) -> ScoredPool:
    """``rows`` scored through the serving probe (or read from ``cache``) as the shipped
    SmolLM2 configs were: every head, the last-token and data-mean streams of ``layers``,
    float32, prompts up to 2,048 tokens, 4,096 tokens per step."""
    settings = ScoringSettings(
        scores_cache=cache,
        batch_size=batch_size,
        max_prompt_tokens=2048,
        hidden_layers=tuple(layers),
        data_mean_layers=tuple(layers),
        max_model_len=4096,
        max_num_batched_tokens=4096,
        dtype="float32",
        seed=0,
    )
    kept, table, skipped, seconds = scores_for(rows, model, "all", settings)
    print(f"scored {len(kept)} rows ({len(skipped)} skipped) in {seconds:.0f} s")
    return ScoredPool(kept, table)


def _as(role: str, pairs: Sequence[LabelledPair]) -> list[LabelledPair]:
    for pair in pairs:
        pair.extra["role"] = role
    return list(pairs)


def transfer_rows(
    tests: Mapping[str, tuple[Sequence[LabelledPair] | Path, Sequence[str] | None]],
) -> list[LabelledPair]:
    """The pool's rows, then each test set's: ``{name: (rows or a JSONL file, layouts)}``;
    layouts None renders each row in ``pair`` only (as the pool's BIPIA rows are drawn, with
    no other layout)."""
    rows = _as("calibration", load_pool())
    for name, (source, layouts) in tests.items():
        pairs = load_pairs(source)[0] if isinstance(source, Path) else list(source)
        tagged = tag_corpus(pairs, name)
        shown = with_drawn_layouts(tagged, 0) if layouts is None else with_layouts(tagged, layouts)
        rows += _as("test", shown)
    return rows


@dataclass(frozen=True)
class KindResult:
    """One kind fitted on the pool (or a fixed config): its threshold, and per test set its
    results per layout (``"all"`` first) with the rows' labels and focus."""

    threshold: float
    fit: ProbeFit | None
    tests: dict[str, LeftOut]


@dataclass(frozen=True)
class TransferResult:
    """Every kind on the test sets (fitted on the whole pool) and each source left out."""

    kinds: dict[str, KindResult]
    left_out: dict[str, dict[str, LeftOut]]  # source -> kind


def _fixed_left_out(
    pool: ScoredPool, config: ModelProbeConfig, sources: Sequence[str]
) -> dict[str, LeftOut]:
    threshold = float(config.threshold or 0.0)
    out = {}
    for source in sources:
        index = np.flatnonzero(pool.corpus == source)
        focus = config_focus(config, pool.table.select(index.tolist()))
        out[source] = LeftOut(per_layout(pool, index, focus, threshold), pool.labels[index], focus)
    return out


def evaluate_transfer(
    pool: ScoredPool,
    recipe: TransferRecipe,
    kinds: Sequence[FitKind],
    attention_layers: Sequence[int],
    last_layers: Sequence[int] = (),
    data_mean_layers: Sequence[int] = (),
    fixed: Mapping[str, ModelProbeConfig] | None = None,
) -> TransferResult:
    """Each of ``kinds`` fitted on the pool's calibration rows and measured on every test set;
    ``fixed`` configs measured as they are (threshold included); then each calibration source
    left out (fixed configs: measured on it, not refitted)."""
    calibration = pool.calibration
    tests = sorted(set(pool.corpus[pool.role == "test"].tolist()))
    fits: dict[str, ProbeFit] = {
        kind: fit_probe(
            pool, kind, calibration, recipe, attention_layers, last_layers, data_mean_layers
        )
        for kind in kinds
    }
    results: dict[str, KindResult] = {}
    for name, config in (fixed or {}).items():
        results[name] = KindResult(float(config.threshold or 0.0), None, {})
        results[name].tests.update(_fixed_left_out(pool, config, tests))
    for kind, probe in fits.items():
        measured = {}
        for source in tests:
            index = np.flatnonzero(pool.corpus == source)
            focus = probe_focus(pool, probe, index)
            measured[source] = LeftOut(
                per_layout(pool, index, focus, probe.threshold), pool.labels[index], focus
            )
        results[kind] = KindResult(probe.threshold, probe, measured)
    left_out = leave_one_source_out(pool, fits, recipe)
    sources = sorted(left_out)
    for name, config in (fixed or {}).items():
        for source, left in _fixed_left_out(pool, config, sources).items():
            left_out[source][name] = left
    return TransferResult(results, left_out)


def summary(result: TransferResult) -> dict[str, dict[str, Measured]]:
    """Per kind: each test set's and each left-out source's results over all layouts."""
    out: dict[str, dict[str, Measured]] = {}
    for name, kind in result.kinds.items():
        entry = {source: left.measured["all"] for source, left in kind.tests.items()}
        entry.update(
            {
                f"{source} left out": per_kind[name].measured["all"]
                for source, per_kind in result.left_out.items()
                if name in per_kind
            }
        )
        out[name] = entry
    return out
