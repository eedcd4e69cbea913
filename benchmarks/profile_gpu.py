"""Where a guarded generate's time goes: cProfile of an in-process engine (caller and worker
in one process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on a dummy-weight Llama shape.

For each (batch, prompt length), two warm-up calls, then ``--rounds`` profiled calls of
prefill-only requests (one generated token, early stops armed at a level no score reaches, so
everything the guard does runs); prints each call's wall time and the top functions by own time
and by cumulative time, and writes the same to ``--out``. The profiler's own overhead inflates
Python-heavy code, so read it for shares, and take timings from ``bench_gpu.py``.

Usage (on the GPU machine, ../shared/gpu/README.md):
    python benchmarks/profile_gpu.py --shape 1b --out benchmarks/results/profile_gpu_h200.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", choices=["1b", "8b"])
    parser.add_argument("--cases", nargs="+", default=["1x2048", "64x512"], help="BATCHxLENGTH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guardrail-bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/profile_gpu.txt")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gpu import requests_of
    from vllm import SamplingParams

    from guardrail.engine import HookedLLM
    from guardrail.testing.dummy_models import build_dummy_model, dummy_probe_config

    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases]
    engine = HookedLLM(
        str(build_dummy_model(args.shape, args.cache)),
        dummy_probe_config(args.shape),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=int(max(n for _, n in cases) * 1.15) + 64,
        gpu_memory_utilization=0.5,
        enforce_eager=args.eager,
        seed=0,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    report = io.StringIO()
    for batch, length in cases:
        for salt in range(2):
            engine.generate(requests_of(length, batch, salt, engine.tokenizer), params)
        profile, walls = cProfile.Profile(), []
        for salt in range(100, 100 + args.rounds):
            requests = requests_of(length, batch, salt, engine.tokenizer)
            start = time.perf_counter()
            profile.enable()
            outputs = engine.generate(requests, params, stop_below=-1.0)
            profile.disable()
            walls.append(round(time.perf_counter() - start, 4))
            failed = [o.error or o.probe.error for o in outputs if o.error or o.probe.error]
            if failed:
                raise SystemExit(f"{len(failed)} requests were not scored, e.g. {failed[0]}")
        print(f"\n## batch {batch}, {length}-token prompts: walls {walls} s\n", file=report)
        stats = pstats.Stats(profile, stream=report)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
    engine.close()
    print(report.getvalue())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.getvalue())


if __name__ == "__main__":
    main()
