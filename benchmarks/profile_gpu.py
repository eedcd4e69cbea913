"""Where a guarded generate's time goes, on a dummy-weight Llama shape, two ways.

``--sampler cprofile`` (default): cProfile of an in-process engine (caller and worker in one
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The profiler's own overhead inflates
Python-heavy code, so read it for shares, and take timings from ``bench_gpu.py``.

``--sampler py-spy --py-spy PATH``: the engines as users run them (engine core in its own
process), sampled by py-spy (a sampling profiler: little overhead, every process). The guarded
engine, plain vLLM and plain vLLM on its V1 model runner stay alive; each arm's timed calls run
alone while py-spy is attached to this process and its children, so each arm's samples are its
own. Writes each arm's raw stacks (``<out stem>-<arm>.txt``) and a summary per process.

For each (batch, prompt length): two warm-up calls, then ``--rounds`` profiled calls of
prefill-only requests (one generated token, early stops armed at a level no score reaches, so
everything the guard does runs); prints each call's wall time and the top functions.

Usage (on the GPU machine, ../shared/gpu/README.md):
    python benchmarks/profile_gpu.py --shape 1b --out benchmarks/results/profile_gpu_h200.txt
    python benchmarks/profile_gpu.py --sampler py-spy --py-spy /path/to/py-spy --rounds 20
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


ROLES = (("worker", "worker_busy_loop"), ("engine core", "EngineCoreProc"))
"""A stack's process role, by a frame it contains (py-spy may label every child with the
parent's pid); anything else is the caller's process."""


def role_of(frames: list[str]) -> str:
    for role, marker in ROLES:
        if any(marker in frame for frame in frames):
            return role
    return "caller"


def summarize(raw: str, top: int) -> str:
    """Per process role (caller, engine core, worker) of py-spy's raw (collapsed) stacks:
    samples, top frames by own and by inclusive samples (a frame counted once per stack)."""
    own: dict[str, Counter[str]] = {}
    inclusive: dict[str, Counter[str]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        process = role_of(frames)
        own.setdefault(process, Counter())[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive.setdefault(process, Counter())[frame] += int(count)
    out = io.StringIO()
    for process in sorted(own, key=lambda p: -sum(own[p].values())):
        total = sum(own[process].values())
        print(f"\n### {process[:120]}: {total} samples\n", file=out)
        for title, counter in (("own", own[process]), ("inclusive", inclusive[process])):
            print(f"top by {title}:", file=out)
            for frame, n in counter.most_common(top):
                print(f"  {n:7d} {100 * n / total:5.1f}%  {frame[:150]}", file=out)
        ours = [(f, n) for f, n in inclusive[process].most_common() if "guardrail/" in f]
        if ours:
            print("the guard's own frames, inclusive:", file=out)
            for frame, n in ours[:top]:
                print(f"  {n:7d} {100 * n / total:5.1f}%  {frame[:150]}", file=out)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", choices=["1b", "8b"])
    parser.add_argument(
        "--probe-layout",
        default="shipped",
        choices=["shipped", "stress"],
        help="the probe: laid out as the shipped attention config, or 128 heads on 16 layers",
    )
    parser.add_argument("--cases", nargs="+", default=["1x2048", "64x512"], help="BATCHxLENGTH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--sampler", default="cprofile", choices=["cprofile", "py-spy"])
    parser.add_argument("--py-spy", type=Path, help="the py-spy binary (--sampler py-spy)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guardrail-bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/profile_gpu.txt")
    args = parser.parse_args()
    if args.sampler == "py-spy" and args.py_spy is None:
        parser.error("--sampler py-spy needs --py-spy PATH (the py-spy binary)")
    if args.sampler == "cprofile":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process
    from guardrail.engine import HookedLLM
    from guardrail.testing.dummy_models import build_dummy_model, dummy_probe_config

    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases]
    model = str(build_dummy_model(args.shape, args.cache))
    engine_args: dict[str, Any] = {
        "load_format": "dummy",
        "dtype": "bfloat16",
        "max_model_len": int(max(n for _, n in cases) * 1.15) + 64,
        "gpu_memory_utilization": 0.5 if args.sampler == "cprofile" else 0.25,
        "enforce_eager": args.eager,
        "seed": 0,
    }
    engines: dict[str, Any] = {
        "guarded": HookedLLM(
            model, dummy_probe_config(args.shape, "attention", args.probe_layout), **engine_args
        )
    }
    if args.sampler == "py-spy":
        from vllm import LLM

        engines["plain"] = LLM(model, **engine_args)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        engines["plain_v1"] = LLM(model, **engine_args)
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    report = io.StringIO()
    for batch, length in cases:
        for arm, engine in engines.items():
            report.write(profile_arm(args, arm, engine, batch, length))
            print(report.getvalue().rsplit("\n## ", 1)[-1][:2000], flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(report.getvalue())
    for engine in engines.values():
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def profile_arm(args: argparse.Namespace, arm: str, engine: Any, batch: int, length: int) -> str:
    """Warm up, then profile ``args.rounds`` calls of one arm; the report's section."""
    from guardrail.probe.prompts import prepare_prompt
    from guardrail.testing.timing import requests_of, time_once

    tokenizer = engine.tokenizer if arm == "guarded" else engine.get_tokenizer()

    def batch_of(salt: int) -> list[Any]:
        requests = requests_of(length, batch, salt, tokenizer)
        return [(r, prepare_prompt(r, tokenizer)) for r in requests]

    for salt in range(2):
        time_once(engine, arm, batch_of(salt), 1)
    batches = [batch_of(100 + salt) for salt in range(args.rounds)]
    walls, failed = [], 0
    out = io.StringIO()
    if args.sampler == "cprofile":
        profile = cProfile.Profile()
        for prepared in batches:
            profile.enable()
            wall, missing = time_once(engine, arm, prepared, 1)
            profile.disable()
            walls.append(round(wall, 4))
            failed += missing
        print(f"\n## {arm}: batch {batch}, {length}-token prompts: walls {walls} s\n", file=out)
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
    else:
        raw = args.out.with_name(f"{args.out.stem}-{arm}-{batch}x{length}.txt")
        raw.parent.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(
            [
                *(str(args.py_spy), "record", "--pid", str(os.getpid()), "--subprocesses"),
                *("--rate", str(args.rate), "--format", "raw", "--output", str(raw)),
                "--nonblocking",
            ]
        )
        time.sleep(2.0)  # py-spy attaches to every process
        for prepared in batches:
            wall, missing = time_once(engine, arm, prepared, 1)
            walls.append(round(wall, 4))
            failed += missing
        spy.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
        spy.wait(timeout=60)
        print(f"\n## {arm}: batch {batch}, {length}-token prompts: walls {walls} s", file=out)
        print("(the samples include about 2 s idle before the first call)", file=out)
        out.write(summarize(raw.read_text() if raw.exists() else "", args.top))
    if failed:
        print(f"{failed} requests were not scored", file=out)
    return out.getvalue()


if __name__ == "__main__":
    main()
