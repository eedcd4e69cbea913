"""The shipped combined probe in eager and in compiled mode, on the transfer benchmark's test sets.

A compiled engine reads the hidden state through stream taps and a worker-kept data-mean memo
(docs/compiled-hidden.md), an eager one through forward hooks. This script serves the test sets
of the transfer table (the hand-written requests in five layouts, AgentDojo tool outputs and,
with ``--bipia-dir``, the held-out BIPIA split) through both engines of the embedded SmolLM2
with the shipped ``combined`` config, one after the other, and reports per set and mode the
AUROC, the clean rows flagged and the injections caught at the config's threshold, and the
largest focus difference between the modes, row by row. No fit happens here. ``--sweep T ...``
adds the clean rows flagged and injections caught at other thresholds (an operating-point
table); the JSON keeps every row's focus by id, so other thresholds need no second serve:
``--rescore RESULT.json`` measures that file's focus instead of serving (same rows, same
config). The sweep always includes the config's recorded operating points
(``ModelProbeConfig.operating_points``: the thresholds ``PromptInjectionPolicy(target_fpr=...)``
applies).

    python benchmarks/detection_compiled.py [--bipia-dir ../shared/data/bipia] [--limit N]

Writes benchmarks/results/detection_compiled_smollm2.{json,md}. ``--config PATH`` serves
another config (e.g. one ``guardrail calibrate`` just wrote), ``--modes eager`` one mode only,
``--stem NAME`` names the result files.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from guardrail.embedded import embedded_model_path
from guardrail.offline.evaluation import markdown_table
from guardrail.offline.layouts import request_for
from guardrail.offline.transfer import measure
from guardrail.offline.transfer_eval import test_sets, transfer_rows
from guardrail.probe.config import load_model_config, read_model_config

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "compiled")
BATCH = 32


def rescored(path: Path, mode: str, rows: list[Any]) -> tuple[np.ndarray, list[str | None], float]:
    """:func:`serve`'s result for ``rows`` from a result file of this script (its focus by row
    id; a row it did not score is NaN with the error "not scored"), with the seconds it took."""
    held = json.loads(path.read_text())
    by_id = held["focus"][mode]
    missing = [p.id for p in rows if p.id not in by_id]
    if missing:
        raise SystemExit(f"{path} has no {mode} focus for {len(missing)} rows, e.g. {missing[0]}")
    focus = np.array([np.nan if by_id[p.id] is None else by_id[p.id] for p in rows], dtype=float)
    errors = [None if np.isfinite(f) else "not scored" for f in focus]
    return focus, errors, float(held["seconds"][mode])


def serve(mode: str, rows: list[Any], config: Any) -> tuple[np.ndarray, list[str | None], float]:
    """Each row's focus (NaN where it was not scored) and error, from one engine in ``mode``."""
    from guardrail.engine import HookedLLM

    started = time.perf_counter()
    engine = HookedLLM(
        str(embedded_model_path()),
        config,
        dtype="float32",
        enforce_eager=mode == "eager",
        max_model_len=4096,
        max_num_batched_tokens=4096,
        seed=0,
    )
    print(f"{mode} engine up in {time.perf_counter() - started:.0f} s")
    focus = np.full(len(rows), np.nan)
    errors: list[str | None] = [None] * len(rows)
    try:
        for lo in tqdm(range(0, len(rows), BATCH), desc=mode, unit="batch"):
            chunk = rows[lo : lo + BATCH]
            for i, out in enumerate(engine.score([request_for(p) for p in chunk]), start=lo):
                probe = out.probe
                if out.error is None and probe is not None and probe.focus is not None:
                    focus[i] = probe.focus
                else:
                    errors[i] = str(out.error or (probe.error if probe else "no probe result"))
    finally:
        engine.close()
    return focus, errors, time.perf_counter() - started


def scored(labels: np.ndarray, focus: np.ndarray, threshold: float) -> dict[str, Any]:
    """The library's ``measure`` of the rows that were scored, with the counts."""
    ok = np.isfinite(focus)
    return {
        "rows": len(labels),
        "scored": int(ok.sum()),
        **measure(labels[ok], focus[ok], threshold),
    }


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bipia-dir", type=Path, help="BIPIA's files: adds the held-out split")
    parser.add_argument("--limit", type=int, help="at most this many rows per set (a quick run)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--config", type=Path, help="serve this config (default: the shipped one)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--stem", default="detection_compiled_smollm2", help="result file stem")
    parser.add_argument(
        "--rescore",
        type=Path,
        help="a result file of this script: measure its rows' focus instead of serving them",
    )
    parser.add_argument(
        "--sweep", type=float, nargs="*", default=[], help="more thresholds to report"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    modes = tuple(args.modes)

    config = (
        read_model_config(args.config)
        if args.config
        else load_model_config(str(embedded_model_path()), "combined")
    )
    assert config.threshold is not None
    threshold = float(config.threshold)
    split = ROOT / "docs" / "bipia_heldout_split.json"
    tests = test_sets(ROOT / "benchmarks" / "data", split, args.bipia_dir)
    rows = [p for p in transfer_rows(tests) if p.extra.get("role") == "test"]
    if args.limit:  # the first rows of each set
        seen: dict[str, int] = {}
        limited = []
        for p in rows:
            seen[p.extra["corpus"]] = seen.get(p.extra["corpus"], 0) + 1
            if seen[p.extra["corpus"]] <= args.limit:
                limited.append(p)
        rows = limited
    sets = sorted({p.extra["corpus"] for p in rows})
    labels = np.array([p.label for p in rows])
    args.sweep = sorted({*config.operating_points.values(), *args.sweep})
    served = (
        {mode: rescored(args.rescore, mode, rows) for mode in modes}
        if args.rescore
        else {mode: serve(mode, rows, config) for mode in modes}
    )
    focus = {mode: served[mode][0] for mode in modes}
    first, last = focus[modes[0]], focus[modes[-1]]  # one mode: no difference to report
    both = np.isfinite(first) & np.isfinite(last)
    result: dict[str, Any] = {
        "config": config.source,
        "threshold": config.threshold,
        "seconds": {mode: round(served[mode][2], 1) for mode in modes},
        "errors": {mode: sorted({e for e in served[mode][1] if e}) for mode in modes},
        "max_focus_difference": float(np.max(np.abs(first - last)[both])),
        "sets": {},
        "sweep": {},
        "focus": {
            mode: {
                p.id: None if not np.isfinite(f) else round(float(f), 6)
                for p, f in zip(rows, focus[mode], strict=True)
            }
            for mode in modes
        },
    }
    sweep_table: dict[str, dict[str, Any]] = {}
    table: dict[str, dict[str, Any]] = {}
    for name in sets:
        member = np.array([p.extra["corpus"] == name for p in rows])
        cells = {mode: scored(labels[member], focus[mode][member], threshold) for mode in modes}
        result["sets"][name] = cells
        diff = np.abs(first[member & both] - last[member & both])
        table[name] = {"rows": str(cells[modes[0]]["rows"]), "max focus diff": f"{diff.max():.1e}"}
        for mode in modes:
            area = cells[mode]["auroc"]
            table[name][f"AUROC {mode}"] = "n/a" if area is None else f"{area:.3f}"
            table[name][f"clean flagged {mode}"] = percent(cells[mode]["flagged_clean"])
            table[name][f"caught {mode}"] = percent(cells[mode]["caught"])
        result["sweep"][name] = {
            mode: [scored(labels[member], focus[mode][member], t) for t in args.sweep]
            for mode in modes
        }
        for mode in modes:
            sweep_table[f"{name} ({mode})"] = {
                f"{t:g}": f"{percent(c['flagged_clean'])} / {percent(c['caught'])}"
                for t, c in zip(args.sweep, result["sweep"][name][mode], strict=True)
            }
    columns = ["rows"] + [
        f"{what} {mode}" for what in ("AUROC", "clean flagged", "caught") for mode in modes
    ]
    if len(modes) > 1:
        columns.append("max focus diff")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown_table(table, columns)
    if args.sweep:
        text += "\n\nClean rows flagged / injections caught at each threshold:\n\n"
        text += markdown_table(sweep_table, [f"{t:g}" for t in args.sweep])
    (args.out / f"{args.stem}.md").write_text(text + "\n")
    print(text)
    print(f"largest focus difference eager vs compiled: {result['max_focus_difference']:.2e}")


if __name__ == "__main__":
    main()
