"""Operations the probe issues per engine step, by phase: a count that does not depend on the host.

On a GPU the probe's cost in a step is mostly host time around small kernels, which a shared or
slow host makes hard to time (docs/gpu.md: plain vLLM's own host time moves by 25 % between
leases). The number of PyTorch operations each phase dispatches per step does not move: this
script counts them (every aten operation, kernels and views alike, under a
``TorchDispatchMode``) for the step plan, the per-layer scoring, the end of the step and the stop
logits processor, next to their host milliseconds, on a CPU engine in this process.

The model is a dummy-weight Llama with the 1B shape's attention layout (16 layers, 32 heads of
32, 8 KV heads) and a small hidden size so the CPU runs it quickly (``--kind combined``: the 1B
hidden size, which its read-outs index), probed like the GPU benchmarks
(``dummy_probe_config("1b", kind, layout)``: ``--probe-layout stress``, 128 heads on 16 layers,
or ``shipped``, 42 heads on 5 layers; early stop armed). On CPU the probe takes its PyTorch path
(no Triton); the plan, focus, stop decision, table copy and hidden-state read-outs are the same
code as on a GPU. The read-outs are counted as ``memo writes`` (every token's value at its KV
slot, each step: the worker's memos in a compiled engine, ``--compiled``, or the probe's own in
an eager one) and ``hidden read`` (the step's rows' terms). ``--op-names``: which operations,
by phase.

Usage:
    python benchmarks/count_probe_ops.py --out benchmarks/results/probe_ops_<commit>.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = {"plan": "plan", "score_layer": "score_layer", "finish_step": "finish_step"}


def build_model(root: Path, kind: str) -> Path:
    """The dummy 1B attention layout, float32, with hidden size 1024 (32 heads of 32) for the
    attention kind, the 1B shape's 2048 (32 heads of 64) for the combined one."""
    from guardrail.testing.dummy_models import build_dummy_model

    path = build_dummy_model("1b", root / kind)
    config = json.loads((path / "config.json").read_text())
    config.update(intermediate_size=1024, torch_dtype="float32")
    if kind == "attention":
        config.update(hidden_size=1024, head_dim=32)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--probe-layout", default="stress", choices=["shipped", "stress"])
    parser.add_argument("--kind", default="attention", choices=["attention", "combined"])
    parser.add_argument("--compiled", action="store_true", help="compiled mode (default: eager)")
    parser.add_argument("--op-names", action="store_true", help="record which operations, by phase")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guardrail-ops"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/probe_ops.json")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process
    from torch.utils._python_dispatch import TorchDispatchMode
    from tqdm import tqdm
    from vllm import SamplingParams

    from guardrail.engine import HookedLLM
    from guardrail.testing.dummy_models import dummy_probe_config
    from guardrail.testing.timing import requests_of
    from guardrail.worker import hidden as worker_hidden
    from guardrail.worker import probe as worker_probe
    from guardrail.worker.stop import ProbeStopLogitsProcessor

    ops: dict[str, int] = defaultdict(int)
    names: dict[str, Counter[str]] = defaultdict(Counter)
    seconds: dict[str, float] = defaultdict(float)

    class Count(TorchDispatchMode):
        def __init__(self, label: str) -> None:
            super().__init__()
            self.label = label

        def __torch_dispatch__(self, func: Any, types: Any, a: Any = (), kw: Any = None) -> Any:
            ops[self.label] += 1
            if args.op_names:
                names[self.label][str(func.overloadpacket.__name__)] += 1
            return func(*a, **(kw or {}))

    counting = {"on": False}

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                if counting["on"]:
                    with Count(label):
                        return original(*a, **kw)
                return original(*a, **kw)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    for name, label in PHASES.items():
        wrap(worker_probe.Probe, name, label)
    wrap(ProbeStopLogitsProcessor, "apply", "stop processor")
    wrap(worker_hidden.MemoWriter, "__call__", "memo writes")  # compiled: the worker's memos
    wrap(worker_hidden.HiddenReader, "remember", "memo writes")  # eager: the probe's own
    wrap(worker_hidden.HiddenReader, "read", "hidden read")
    model = build_model(args.cache, args.kind)
    engine = HookedLLM(
        str(model),
        dummy_probe_config("1b", args.kind, args.probe_layout),
        load_format="dummy",
        dtype="float32",
        max_model_len=4 * args.tokens + 256,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=not args.compiled,
        seed=0,
    )
    tokenizer = engine.llm.get_tokenizer()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    try:
        for batch in args.batches:
            counted: dict[str, int] = {}
            counted_names: dict[str, dict[str, int]] = {}
            timed: dict[str, list[float]] = defaultdict(list)
            for salt in tqdm(range(args.rounds + 2), desc=f"batch {batch}", leave=False):
                requests = requests_of(args.tokens, batch, salt * 7919 + batch, tokenizer)
                for count in (True, False):  # one round counted, one timed (counting is slow)
                    ops.clear()
                    names.clear()
                    seconds.clear()
                    counting["on"] = count
                    outs = engine.generate(requests, params, stop_below=-1.0)
                    if any(o.probe is None or o.probe.focus is None for o in outs):
                        raise SystemExit("a request was not scored: the counts would be wrong")
                    if salt < 1:
                        continue
                    if count:
                        counted = dict(ops)
                        counted_names = {k: dict(v.most_common()) for k, v in names.items()}
                    else:
                        for label, spent in seconds.items():
                            timed[label].append(spent * 1e3)
            row: dict[str, Any] = {
                "kind": args.kind,
                "compiled": args.compiled,
                "layout": args.probe_layout,
                "batch": batch,
                "prompt_tokens": args.tokens,
                "ops_per_call": counted,
                "host_ms_per_call": {k: round(statistics.median(v), 3) for k, v in timed.items()},
            }
            if args.op_names:
                row["op_names"] = counted_names
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
