"""Where a guarded generate's host time goes, by phase, next to plain vLLM (GPU machine).

An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: caller, engine core and worker in
one process) on a dummy-weight Llama shape; the guard's entry points are wrapped with timers,
caller side (render and tokenize, enqueue, wait, result pop, result assembly) and worker side
(dispatch, step plan, per-layer scoring, end of step, stop logits processor, pop). On a GPU the
worker's host times are launch overhead unless a phase synchronises with the device; with
``--sync-debug`` one guarded call runs under ``torch.cuda.set_sync_debug_mode("warn")``, which
names every synchronising call site (vLLM's own included).

Prints, per (batch, prompt length): median wall time of guarded and plain (plain fed the same
token ids), and the guard's per-call milliseconds in each phase (median over rounds).

Usage (on the GPU machine, ../shared/gpu/README.md):
    python benchmarks/profile_phases.py --shape 1b --cases 1x512 64x512 --rounds 7
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SPENT: dict[str, float] = defaultdict(float)


def timed(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` (a class or an object) so its host seconds add up under ``label``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def instrument(engine: Any) -> None:
    from guardrail.engine.client import ProbeClient
    from guardrail.worker import probe as worker_probe
    from guardrail.worker.stop import ProbeStopLogitsProcessor

    timed(engine, "prepare_many", "caller: render + tokenize")
    timed(engine.llm, "enqueue", "caller: enqueue (vLLM add_request)")
    timed(engine.llm, "wait_for_completion", "caller: wait (engine steps)")
    timed(engine.llm, "collective_rpc", "caller: pop rpc")
    timed(ProbeClient, "result", "caller: result assembly")
    timed(worker_probe.Probe, "awaits_score", "worker: dispatch check")
    timed(worker_probe.Probe, "plan", "worker: plan (every layer)")
    timed(worker_probe.Probe, "score_layer", "worker: score_layer")
    timed(worker_probe.Probe, "finish_step", "worker: finish_step")
    timed(worker_probe.Probe, "pop", "worker: pop")
    timed(ProbeStopLogitsProcessor, "apply", "worker: stop processor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", choices=["1b", "8b"])
    parser.add_argument("--cases", nargs="+", default=["1x512", "64x512"], help="BATCHxLENGTH")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--sync-debug", action="store_true")
    parser.add_argument("--model", help="a model directory instead of the dummy shape (smoke runs)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guardrail-bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/phases.json")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from bench_gpu import requests_of, time_once

    from guardrail.engine import HookedLLM
    from guardrail.probe.prompts import prepare_prompt
    from guardrail.testing.dummy_models import build_dummy_model, dummy_probe_config

    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases]
    model = args.model or str(build_dummy_model(args.shape, args.cache))
    engine_args: dict[str, Any] = {
        "load_format": "dummy",
        "dtype": args.dtype,
        "max_model_len": int(max(n for _, n in cases) * 1.15) + 64,
        **(
            {"gpu_memory_utilization": 0.3}
            if torch.cuda.is_available()
            else {"kv_cache_memory_bytes": 1 << 30}
        ),
        "enforce_eager": args.eager,
        "seed": 0,
    }
    guarded = HookedLLM(model, dummy_probe_config(args.shape), **engine_args)
    # one engine per process (vLLM's CUDA-graph state is global): "plain" is the same engine's
    # vllm.LLM fed requests without a probe spec (nothing scored; its wrappers find no rows)
    plain = guarded.llm
    tokenizer = plain.get_tokenizer()
    instrument(guarded)
    rows = []
    for batch, length in cases:
        walls: dict[str, list[float]] = {"guarded": [], "plain": []}
        phases: dict[str, list[float]] = defaultdict(list)
        for salt in range(args.rounds + 2):
            reqs = requests_of(length, batch, salt * 7919 + batch, tokenizer)
            prepared = [(r, prepare_prompt(r, tokenizer)) for r in reqs]
            SPENT.clear()
            debug = args.sync_debug and salt == 1 and torch.cuda.is_available()
            if debug:
                torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wall, missing = time_once(guarded, "guarded", prepared, 1)
            if debug:
                torch.cuda.set_sync_debug_mode(0)
                sites = sorted({f"{w.filename}:{w.lineno}" for w in caught})
                print(f"sync sites, batch {batch}: {json.dumps(sites, indent=1)}", flush=True)
            spent = dict(SPENT)
            plain_wall, _ = time_once(plain, "plain_text", prepared, 1)  # own cache salt
            if salt < 2 or missing:
                continue
            walls["guarded"].append(wall)
            walls["plain"].append(plain_wall)
            for label, seconds in spent.items():
                phases[label].append(seconds)
        row = {
            "batch": batch,
            "prompt_tokens": len(prepared[0][1].token_ids),
            "guarded_ms": round(1e3 * statistics.median(walls["guarded"]), 2),
            "plain_ms": round(1e3 * statistics.median(walls["plain"]), 2),
            "phases_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in phases.items()},
        }
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    guarded.close()


if __name__ == "__main__":
    main()
