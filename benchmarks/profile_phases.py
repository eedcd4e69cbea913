"""Where a guarded generate's host time goes, by phase, next to plain vLLM (GPU machine).

One engine on a dummy-weight Llama shape, the guard's entry points wrapped with timers: caller
side (render and tokenize, enqueue, wait, result pop, result assembly) and worker side (step
plan, per-layer scoring, end of step and its three parts, stop logits processor, pop, and with
``--kind combined`` the hidden-state read-outs' memo writes and reads; and vLLM's
``execute_model``, counted, so the number of engine steps per call shows). By default the
engine runs as vLLM runs it for a user (engine core in its own process: the worker timers are
installed there through ``collective_rpc``); ``--in-process`` puts caller, engine core and
worker in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where nothing overlaps and the
phases add up.

"Plain" is the same engine fed requests without a probe spec (one engine per process: vLLM's
CUDA-graph state is global), once with the prompts' token ids and once with their text.

``--variants`` runs every case under several caller settings, to separate their effects:
``default``; ``unarmed`` (no ``stop_below``: the stop logits processor has nothing to do);
``one-chunk`` (every request rendered before any is enqueued, instead of a group of
``HookedLLM.render_group`` at a time);
``tok-serial`` / ``tok-parallel`` (``TOKENIZERS_PARALLELISM`` false / true for the caller's
batch tokenizing). On a GPU the worker's host times are launch overhead unless a phase
synchronises with the device; with ``--sync-debug`` one guarded call runs under
``torch.cuda.set_sync_debug_mode("warn")`` (in-process only), which names every synchronising
call site (vLLM's own included). ``--torch-profile`` adds one guarded call per case under
torch.profiler in the worker: each timed worker phase with the GPU time of the kernels it
launched and the number of torch ops it called, then the ops by self CPU time, then the GPU's
idle time between its kernels, charged to the phase the host was in meanwhile (what the host
was doing while the device waited for it: the phases on the step's critical path).

Prints, per (variant, batch, prompt length): median wall time of guarded and plain, and the
per-call milliseconds in each phase (median over rounds).

Usage (on the GPU machine, ../shared/gpu/README.md):
    python benchmarks/profile_phases.py --shape 1b --cases 1x512 64x512 --rounds 7 \
        --variants default one-chunk tok-serial
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SPENT: dict[str, float] = defaultdict(float)
VARIANTS = ("default", "unarmed", "one-chunk", "tok-serial", "tok-parallel")
# while torch.profiler runs (``--torch-profile``), each timed call is also one of its ranges,
# named by its label, so the profiler gives each phase's kernels' GPU time. An environment
# variable of the worker's process, not a global: the functions ``collective_rpc`` sends from
# this script arrive each with its own copy of the script's globals
PHASE_RANGES = "GUARDRAIL_PROFILE_PHASE_RANGES"
EXECUTE_MODEL = "worker: execute_model (vLLM step)"  # vLLM's step: the phases' parent


def timed(owner: Any, name: str, label: str, spent: dict[str, float]) -> None:
    """Wrap ``owner.name`` (a class or an object) so its host seconds add up under ``label``,
    and its calls under ``label + " (calls)"``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            if os.environ.get(PHASE_RANGES):
                import torch

                with torch.profiler.record_function(label):
                    return original(*args, **kwargs)
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
            spent[label + " (calls)"] += 1

    setattr(owner, name, wrapper)


def instrument_caller(engine: Any) -> None:
    from guardrail.engine.client import ProbeClient
    from guardrail.engine.inbox import ResultInbox

    timed(engine, "prepare_many", "caller: render + tokenize", SPENT)
    timed(engine.llm, "enqueue", "caller: enqueue (vLLM add_request)", SPENT)
    timed(engine.llm, "wait_for_completion", "caller: wait (engine steps)", SPENT)
    timed(engine.llm, "collective_rpc", "caller: pop rpc", SPENT)
    timed(ResultInbox, "take", "caller: pushed results (wait after the outputs)", SPENT)
    timed(ProbeClient, "result", "caller: result assembly", SPENT)


def install_worker_timers(worker: Any) -> None:
    """Runs in the worker's process (sent by ``collective_rpc``): wrap the probe's entry points
    and vLLM's ``execute_model`` with timers kept on the worker object."""
    from guardrail.worker import hidden as worker_hidden
    from guardrail.worker import probe as worker_probe
    from guardrail.worker.stop import ProbeStopLogitsProcessor

    spent: dict[str, float] = defaultdict(float)
    worker.guardrail_phase_seconds = spent
    timed(worker_probe.Probe, "awaits_score", "worker: dispatch check", spent)
    timed(worker_probe.Probe, "plan", "worker: plan (every layer)", spent)
    timed(worker_probe.Probe, "score_layer", "worker: score_layer", spent)
    timed(worker_probe.Probe, "finish_step", "worker: finish_step", spent)
    # its parts: the table (stats, terms, focus), the stop decision, the copy to the host
    timed(worker_probe.Probe, "_device_table", "worker: finish_step: table and focus", spent)
    timed(worker_probe.Probe, "_decide_stops", "worker: finish_step: stop decision", spent)
    timed(worker_probe.Probe, "_to_host", "worker: finish_step: copy to host", spent)
    # the hidden-state read-outs (combined kind): every token's memo values, every step (the
    # worker's memos in a compiled engine, the probe's own in an eager one); the rows' terms
    timed(worker_hidden.LayerMemos, "__call__", "worker: memo writes (compiled)", spent)
    timed(worker_hidden.HiddenReader, "remember", "worker: memo writes (eager)", spent)
    timed(worker_hidden.HiddenReader, "read", "worker: hidden read", spent)
    timed(worker_probe.Probe, "pop", "worker: pop", spent)
    timed(ProbeStopLogitsProcessor, "apply", "worker: stop processor", spent)
    timed(worker, "execute_model", EXECUTE_MODEL, spent)


def read_worker_timers(worker: Any) -> dict[str, float]:
    """Runs in the worker's process: the timers since the last read, then cleared."""
    spent = worker.guardrail_phase_seconds
    out = dict(spent)
    spent.clear()
    return out


def start_torch_profile(worker: Any) -> None:
    """Runs in the worker's process: start ``torch.profiler`` (CPU and CUDA, with stacks)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    worker.guardrail_torch_profile = torch.profiler.profile(activities=activities, with_stack=True)
    worker.guardrail_torch_profile.__enter__()
    os.environ[PHASE_RANGES] = "1"


def stop_torch_profile(worker: Any, rows: int) -> str:
    """Runs in the worker's process: stop the profiler; the worker's timed phases (each with
    the GPU time of the kernels launched inside it, nested phases counted in their parents
    too), then its table of ops by self CPU time, each with the guard's own call site (the
    innermost frame under ``guardrail/``, where the build records Python frames)."""
    import torch

    profile = worker.guardrail_torch_profile
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    os.environ.pop(PHASE_RANGES, None)
    profile.__exit__(None, None, None)
    spent: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    try:
        events = profile.events()
    except Exception as exc:  # e.g. torch 2.13's CPU build fails to parse its own event names
        return f"torch.profiler could not read its events: {type(exc).__name__}: {exc}"
    # per phase: CPU us, calls, GPU us of its kernels, torch ops called inside it (nested too)
    phases: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    labels = set(worker.guardrail_phase_seconds) | {EXECUTE_MODEL}
    for event in events:
        if event.name in labels and event.device_type == torch.autograd.DeviceType.CPU:
            phase = phases[event.name]
            phase[0] += event.cpu_time_total
            phase[1] += 1
            phase[2] += event.device_time_total
            inside = list(event.cpu_children)
            while inside:
                child = inside.pop()
                phase[3] += child.name.startswith(("aten::", "_C::"))
                inside.extend(child.cpu_children)
    lines = [f"{'cpu us':>12} {'calls':>6} {'gpu us':>12} {'ops':>6}  worker phase"]
    for name, (cpu, calls, gpu, ops) in sorted(phases.items()):
        lines.append(f"{cpu:12.0f} {calls:6.0f} {gpu:12.0f} {ops:6.0f}  {name}")
    lines.append("")
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        site = next((f for f in event.stack if "guardrail/" in f), "vllm or torch")
        entry = spent[(event.name, site.split("guardrail/")[-1])]
        entry[0] += event.self_cpu_time_total
        entry[1] += 1
        entry[2] += getattr(event, "self_device_time_total", 0.0)
    lines.append(f"{'self cpu us':>12} {'calls':>6} {'self gpu us':>12}  op @ guard call site")
    for (name, site), (cpu, calls, gpu) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{cpu:12.0f} {calls:6.0f} {gpu:12.0f}  {name} @ {site}")
    lines.append("")
    lines.extend(gpu_idle_by_phase(events, labels))
    return "\n".join(lines)


def gpu_idle_by_phase(events: Any, labels: set[str]) -> list[str]:
    """Where the GPU waited for the host: the gaps between its work (every device event, merged),
    from its first to its last, each charged to the innermost timed phase the host was in at
    the gap's middle (the host and device clocks are the profiler's one timeline). GPU idle time
    charged to a guard phase is host work of the guard on the step's critical path; idle time
    inside vLLM's step but in no guard phase is vLLM's own host time."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    busy = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    if not busy:
        return ["no device events: no GPU idle time to place"]
    phases = sorted(  # shortest first: the first that holds a moment is the innermost
        (e.time_range.end - e.time_range.start, e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.name in labels and e.device_type != cuda
    )
    idle: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    first, end = busy[0]
    for start, stop in busy[1:]:
        if start > end:
            middle = (start + end) / 2
            host = next((n for _, a, b, n in phases if a <= middle <= b), "in no timed phase")
            idle[host][0] += start - end
            idle[host][1] += 1
        end = max(end, stop)
    gaps = sum(us for us, _ in idle.values())
    window = end - first
    lines = [
        f"GPU window {window:.0f} us: busy {window - gaps:.0f} us, idle {gaps:.0f} us; "
        "idle time by what the host was in",
        f"{'idle us':>12} {'gaps':>6}  host in",
    ]
    for name, (us, count) in sorted(idle.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{us:12.0f} {count:6.0f}  {name}")
    return lines


def guarded_once(engine: Any, reqs: list[Any], armed: bool) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    outs = engine.generate(reqs, params, stop_below=-1.0 if armed else None)
    wall = time.perf_counter() - start
    missing = sum(o.probe is None or o.probe.focus is None for o in outs)
    return wall, missing


def plain_once(llm: Any, prompts: list[Any]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def variant_settings(variant: str) -> tuple[bool, int, str | None]:
    """(stop armed, render group size, TOKENIZERS_PARALLELISM) for a variant."""
    from guardrail.engine import HookedLLM

    group = 1 << 30 if variant == "one-chunk" else HookedLLM.render_group
    parallel = {"tok-serial": "false", "tok-parallel": "true"}.get(variant)
    return variant != "unarmed", group, parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", choices=["1b", "8b"])
    parser.add_argument(
        "--probe-layout",
        default="shipped",
        choices=["shipped", "stress"],
        help="the probe: laid out as the shipped config of its kind, or 128 heads on 16 layers "
        "(guardrail.testing.dummy_models.dummy_probe_config)",
    )
    parser.add_argument(
        "--kind",
        default="attention",
        choices=["attention", "combined"],
        help="the probe's kind: attention-only, or with the hidden-state read-outs",
    )
    parser.add_argument("--cases", nargs="+", default=["1x512", "64x512"], help="BATCHxLENGTH")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variants", nargs="+", default=["default"], choices=VARIANTS)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--sync-debug", action="store_true")
    parser.add_argument(
        "--torch-profile",
        action="store_true",
        help="after the cases, one guarded call per case under torch.profiler in the worker: "
        "ops by self CPU time, with the guard's call site",
    )
    parser.add_argument("--model", help="a model directory instead of the dummy shape (smoke runs)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guardrail-bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/phases.json")
    args = parser.parse_args()
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # the worker timers travel to the engine core as a pickled function; with this set, vLLM
    # also types every element of a utility call's result (the guard's pop is built for that)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import torch
    from vllm.inputs import TextPrompt, TokensPrompt

    from guardrail.engine import HookedLLM
    from guardrail.probe.prompts import prepare_prompt
    from guardrail.testing.dummy_models import build_dummy_model, dummy_probe_config
    from guardrail.testing.timing import requests_of

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
    config = dummy_probe_config(args.shape, args.kind, args.probe_layout)
    guarded = HookedLLM(model, config, **engine_args)
    plain = guarded.llm
    tokenizer = plain.get_tokenizer()
    plain.collective_rpc(install_worker_timers)
    instrument_caller(guarded)
    rows: list[dict[str, Any]] = []
    for variant in args.variants:
        armed, guarded.render_group, parallel = variant_settings(variant)
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        if parallel is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = parallel
        for batch, length in cases:
            walls: dict[str, list[float]] = defaultdict(list)
            phases: dict[str, list[float]] = defaultdict(list)
            for salt in range(args.rounds + 2):
                reqs = requests_of(length, batch, salt * 7919 + batch + 31 * len(rows), tokenizer)
                prepared = [prepare_prompt(r, tokenizer) for r in reqs]
                plain.collective_rpc(read_worker_timers)
                SPENT.clear()
                debug = args.sync_debug and args.in_process and salt == 1
                if debug and torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    wall, missing = guarded_once(guarded, reqs, armed)
                if debug and torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode(0)
                    sites = sorted({f"{w.filename}:{w.lineno}" for w in caught})
                    print(f"sync sites, batch {batch}: {json.dumps(sites, indent=1)}", flush=True)
                spent = dict(SPENT)  # before the timer read below (itself an rpc)
                spent.update(plain.collective_rpc(read_worker_timers)[0])
                # each plain arm has its own cache salt: the guarded arm just prefilled the same
                # ids, and a plain arm that found them cached would do a fraction of the work
                ids = [
                    TokensPrompt(prompt_token_ids=p.token_ids, cache_salt="ids") for p in prepared
                ]
                texts = [TextPrompt(prompt=p.text, cache_salt="text") for p in prepared]
                plain_wall = plain_once(plain, ids)
                plain_steps = plain.collective_rpc(read_worker_timers)[0]
                text_wall = plain_once(plain, texts)
                if salt < 2 or missing:
                    continue
                walls["guarded"].append(wall)
                walls["plain"].append(plain_wall)
                walls["plain_text"].append(text_wall)
                for label, seconds in spent.items():
                    phases[label].append(seconds)
                for label, seconds in plain_steps.items():
                    if "execute_model" in label:
                        phases[label.replace("worker:", "plain:")].append(seconds)
            row: dict[str, Any] = {
                "variant": variant,
                "kind": args.kind,
                "layout": args.probe_layout,
                "multiprocess": not args.in_process,
                "batch": batch,
                "prompt_tokens": len(prepared[0].token_ids),
                **{f"{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in walls.items()},
                "phases_ms": {
                    k: round(statistics.median(v) * (1 if "(calls)" in k else 1e3), 3)
                    for k, v in sorted(phases.items())
                },
            }
            print(json.dumps(row, indent=1), flush=True)
            rows.append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
        if args.torch_profile:
            for batch, length in cases:
                reqs = requests_of(length, batch, 99_991 + batch, tokenizer)
                plain.collective_rpc(start_torch_profile)
                guarded_once(guarded, reqs, armed)
                table = plain.collective_rpc(stop_torch_profile, args=(40,))[0]
                print(f"torch.profiler, {variant}, batch {batch} x {length}:\n{table}", flush=True)
        if parallel is not None:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
    guarded.close()


if __name__ == "__main__":
    main()
