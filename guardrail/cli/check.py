"""``guardrail check``: start the guarded engine a command line describes and say what it runs.

It starts a ``HookedLLM`` exactly as serving would (the same defaults: on CPU float32, eager,
a 1 GiB KV cache; elsewhere vLLM's own), answers its start-up self-test (one real request that
must come back scored), prints the engine's facts and the probe config it reads, and closes.
A configuration the probe cannot read (an attention backend without a KV reader, a quantized
KV cache, full CUDA graphs) fails here with the error serving would give, at start-up.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from guardrail.cli.options import add_engine_arg
from guardrail.cli.output import write_json

__all__ = ["configure", "describe", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model directory (default: the embedded SmolLM2)"
    )
    parser.add_argument(
        "--probe-config",
        default=None,
        help="a config file or a shipped variant (default: what the engine would read)",
    )
    add_engine_arg(parser)
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the facts to this JSON file (default: print them only)",
    )


def describe(engine: Any) -> dict[str, Any]:
    """What a started ``HookedLLM`` runs: engine facts and the probe config it reads."""
    import vllm

    info, config = engine.model_info, engine.config
    calibration = config.calibration
    return {
        "model": engine.model,
        "vllm": vllm.__version__,
        "device": info["device"],
        "dtype": info.get("dtype"),
        "attention_backend": info["backend"],
        "kv_cache_dtype": info["kv_cache_dtype"],
        "block_size": info["block_size"],
        "graph_mode": "eager"
        if info["enforce_eager"]
        else f"compiled ({info['compilation_mode']}, CUDA graphs {info['cudagraph_mode']})",
        "tensor_parallel_size": info["tp_size"],
        "pipeline_parallel_size": info["pp_size"],
        "probe": {
            "model_id": config.model_id,
            "kind": config.probe,
            "heads": len(config.heads),
            "hidden_layers": list(config.hidden_layers),
            "threshold": config.threshold,
            "calibrated": calibration is not None,
            "calibration": None if calibration is None else calibration.model_dump(mode="json"),
            "operating_points": {f"{r:g}": t for r, t in config.operating_points.items()},
        },
        "early_stop": info["pp_size"] == 1,
        "steering": bool(info["enforce_eager"]),
        "self_test": "scored",
    }


def _lines(facts: dict[str, Any]) -> list[str]:
    probe = facts["probe"]
    calibrated = (
        "calibrated"
        if probe["calibrated"]
        else "NOT calibrated (published heads, untuned threshold): run `guardrail calibrate "
        "--model MODEL --out DIR`"
    )
    hidden = f", hidden-state layers {probe['hidden_layers']}" if probe["hidden_layers"] else ""
    points = probe["operating_points"]
    operating = (
        [
            "operating points "
            + ", ".join(f"{float(rate):.0%}: {t}" for rate, t in points.items())
            + " (the threshold flagging at most that share of every calibration source's clean "
            "rows; a policy applies one with target_fpr=RATE)"
        ]
        if points
        else []
    )
    return [
        f"model            {facts['model']}",
        f"vLLM             {facts['vllm']} on {facts['device']}",
        f"dtype            {facts['dtype']}",
        f"attention        {facts['attention_backend']} (KV cache {facts['kv_cache_dtype']}, "
        f"block size {facts['block_size']})",
        f"graph mode       {facts['graph_mode']}",
        f"parallel         tensor {facts['tensor_parallel_size']}, "
        f"pipeline {facts['pipeline_parallel_size']}",
        f"probe config     {probe['model_id']}: {probe['kind']} over {probe['heads']} heads"
        f"{hidden}, threshold {probe['threshold']}",
        f"calibration      {calibrated}",
        *operating,
        f"early stop       {'available' if facts['early_stop'] else 'no (pipeline parallel)'}",
        f"steering         {'available' if facts['steering'] else 'no (needs enforce_eager)'}",
        "self-test        one request scored at start-up",
    ]


def run(args: argparse.Namespace, engine: Any) -> int:
    from guardrail.engine import HookedLLM

    own = engine is None
    if own:
        engine = HookedLLM(args.model, args.probe_config, **dict(args.engine_arg))
    try:
        facts = describe(engine)
    finally:
        if own:
            engine.close()
    print(json.dumps(facts, indent=1) if args.json else "\n".join(_lines(facts)))
    if args.out:
        write_json(args.out, facts)
    return 0
