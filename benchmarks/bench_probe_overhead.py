"""Throughput of the guarded engine against plain vLLM with the same engine arguments.

Engines, all in one run, each in its own engine process (vLLM's default multi-process mode):
- ``plain-eager``: ``vllm.LLM(enforce_eager=True)``, the baseline for the guarded eager engine;
- ``guarded-eager``: ``HookedLLM`` with the same arguments;
- ``plain-compiled``: ``vllm.LLM`` in vLLM's default compiled mode (the price of eager mode);
- ``guarded-compiled``: ``HookedLLM`` in compiled mode (the probe sits at the attention
  implementation, which vLLM runs as Python between compiled pieces, so it still fires).

For each prompt length and batch size the engines run alternately, ``--repeats`` times, on the
same token ids (fresh prompts every repeat, so every run does a real prefill, no prefix hits).
Reported: median wall time per engine, throughput ratio guarded/plain, and the probe's own time
per request as measured inside the worker.

Usage:
    python benchmarks/bench_probe_overhead.py                   # embedded SmolLM2
    python benchmarks/bench_probe_overhead.py --model DIR --lengths 64 512 --batches 1 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "invoice amount paid account supplier date total order shipment customer report "
    "meeting schedule project budget review quarter sales region product team"
).split()


def make_requests(length: int, batch: int, salt: int, tokenizer: Any) -> list[tuple[str, str]]:
    """``batch`` (instruction, data) pairs whose rendered prompt has about ``length`` tokens."""
    from guardrail.probe.prompts import prepare_prompt

    requests = []
    for b in range(batch):
        instruction = f"[{salt}-{b}] You are an assistant. Answer the question about the document."
        words = [WORDS[(salt * 31 + b * 7 + i) % len(WORDS)] for i in range(length)]
        lo, hi = 1, length
        while lo < hi:  # shortest data that reaches the target length
            mid = (lo + hi) // 2
            n = len(prepare_prompt((instruction, " ".join(words[:mid])), tokenizer).token_ids)
            lo, hi = (mid + 1, hi) if n < length else (lo, mid)
        requests.append((instruction, " ".join(words[:lo])))
    return requests


def start_engines(
    model: str, names: list[str], engine_args: dict[str, Any], probe_config: str | None
) -> dict[str, Any]:
    from vllm import LLM

    from guardrail.engine import HookedLLM

    engines: dict[str, Any] = {}
    for name in tqdm(names, desc="starting engines"):
        args = {**engine_args, "enforce_eager": name.endswith("eager")}
        engines[name] = (
            HookedLLM(model, probe_config, **args)
            if name.startswith("guarded")
            else LLM(model, **args)
        )
    return engines


def run_once(engine: Any, prepared: list[Any], max_tokens: int) -> tuple[float, list[float]]:
    """Wall time of one batch, and the probe's own seconds per request (guarded engines)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if hasattr(engine, "generate") and hasattr(engine, "prepare"):
        start = time.perf_counter()
        outs = engine.generate([p.request for p in prepared], params)
        wall = time.perf_counter() - start
        return wall, [o.probe.probe_seconds for o in outs]
    prompts = [TokensPrompt(prompt_token_ids=p.prompt.token_ids) for p in prepared]
    start = time.perf_counter()
    engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, []


class Prepared:
    def __init__(self, request: tuple[str, str], prompt: Any) -> None:
        self.request, self.prompt = request, prompt


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from guardrail.probe.prompts import prepare_prompt

    model = args.model
    if model is None:
        from guardrail.embedded import embedded_model_path

        model = str(embedded_model_path())
    engine_args = {
        "dtype": "float32",
        "max_model_len": max(args.lengths) + args.max_tokens + 64,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        # four engines live at once: vLLM's CPU default (4 GiB each) no longer fits in 24 GiB
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
        "seed": 0,
    }
    engines = start_engines(model, args.engines, engine_args, args.probe_config)
    first = next(iter(engines.values()))
    tokenizer = getattr(first, "llm", first).get_tokenizer()
    header = {
        "model": model,
        "engine_args": engine_args,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "machine": machine_info(),
    }
    rows: list[dict[str, Any]] = []
    cases = [(length, batch) for length in args.lengths for batch in args.batches]
    progress = tqdm(total=len(cases) * (args.repeats + 1) * len(engines), desc="benchmark")
    for length, batch in cases:
        times: dict[str, list[float]] = {name: [] for name in engines}
        probe: list[float] = []
        for repeat in range(args.repeats + 1):  # repeat 0 warms the shapes up, not timed
            reqs = make_requests(
                length, batch, salt=length * 1000 + batch * 10 + repeat, tokenizer=tokenizer
            )
            prepared = [Prepared(r, prepare_prompt(r, tokenizer)) for r in reqs]
            order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for name in order:
                wall, probe_s = run_once(engines[name], prepared, args.max_tokens)
                if repeat:
                    times[name].append(wall)
                    probe.extend(probe_s if name == "guarded-eager" else [])
                progress.update()
        tokens = sum(len(p.prompt.token_ids) for p in prepared) + batch * args.max_tokens
        rows.append(summarise(length, batch, times, probe, tokens))
        write(args, {**header, "rows": rows})  # partial results survive an interrupted run
    progress.close()
    for engine in engines.values():
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    return {**header, "rows": rows}


def write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(markdown(result))


def summarise(
    length: int,
    batch: int,
    times: dict[str, list[float]],
    probe: list[float],
    tokens: int,
) -> dict[str, Any]:
    """Medians, ratios and spreads of one case; ``tokens`` = prompt + generated per run."""
    med = {name: statistics.median(ts) for name, ts in times.items()}
    row: dict[str, Any] = {
        "prompt_tokens": length,
        "batch": batch,
        "tokens_per_run": tokens,
        "median_seconds": med,
        "all_seconds": times,
        "throughput_tok_s": {n: tokens / t for n, t in med.items()},
    }
    pairs = [
        ("guarded-eager", "plain-eager"),
        ("guarded-compiled", "plain-compiled"),
        ("plain-eager", "plain-compiled"),
        ("guarded-compiled", "plain-eager"),
    ]
    row["ratios"] = {f"{a}/{b}": med[b] / med[a] for a, b in pairs if a in med and b in med}
    # runs alternate, so repeat i of every engine saw the same moment of the machine: the
    # median of the per-repeat ratios is less sensitive to drift than the ratio of medians
    row["paired_ratios"] = {
        f"{a}/{b}": statistics.median(tb / ta for ta, tb in zip(times[a], times[b], strict=True))
        for a, b in pairs
        if a in times and b in times
    }
    row["spread"] = {  # (max - min) / median of each engine's runs: the noise to compare with
        name: (max(ts) - min(ts)) / statistics.median(ts) for name, ts in times.items()
    }
    row["probe_ms_per_request"] = 1000 * statistics.median(probe) if probe else None
    return row


def machine_info() -> dict[str, Any]:
    import torch
    import vllm

    return {
        "load_avg_1min_at_start": round(os.getloadavg()[0], 1),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Probe overhead: guarded engine vs plain vLLM",
        "",
        f"Model `{Path(result['model']).name}`, engine args `{result['engine_args']}`, "
        f"{result['max_tokens']} generated tokens per request, median of {result['repeats']} "
        f"alternating runs. Machine: {result['machine']}.",
        "Throughput ratio = plain median time / guarded median time (1.0 = no cost).",
        "",
        "Paired = median over repeats of plain/guarded within one repeat. Spread = (max - min) / "
        "median of the plain eager runs. Probe share = the probe's own time (measured in the "
        "worker) x batch / guarded eager wall time.",
        "",
        "| prompt tokens | batch | plain eager s | guarded eager s | ratio eager | "
        "paired eager | plain compiled s | guarded compiled s | ratio compiled | "
        "paired compiled | eager/compiled | spread | probe ms/request | probe share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        med, ratio = row["median_seconds"], row["ratios"]

        def cell(d: dict[str, float], k: str, fmt: str = "{:.3f}") -> str:
            return fmt.format(d[k]) if k in d else "-"

        probe = row["probe_ms_per_request"]
        paired, spread = row.get("paired_ratios", {}), row.get("spread", {})
        share = (
            "-"
            if probe is None or "guarded-eager" not in med
            else f"{100 * probe / 1000 * row['batch'] / med['guarded-eager']:.2f} %"
        )
        lines.append(
            f"| {row['prompt_tokens']} | {row['batch']} | {cell(med, 'plain-eager')} | "
            f"{cell(med, 'guarded-eager')} | {cell(ratio, 'guarded-eager/plain-eager')} | "
            f"{cell(paired, 'guarded-eager/plain-eager')} | "
            f"{cell(med, 'plain-compiled')} | {cell(med, 'guarded-compiled')} | "
            f"{cell(ratio, 'guarded-compiled/plain-compiled')} | "
            f"{cell(paired, 'guarded-compiled/plain-compiled')} | "
            f"{cell(ratio, 'plain-eager/plain-compiled')} | "
            f"{cell(spread, 'plain-eager', '{:.0%}')} | "
            f"{'-' if probe is None else f'{probe:.2f}'} | {share} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: embedded SmolLM2)")
    parser.add_argument("--probe-config", default=None, help="probe config JSON (default: shipped)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="KV cache of each of the four engines"
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["plain-eager", "guarded-eager", "plain-compiled", "guarded-compiled"],
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/probe_overhead.json")
    parser.add_argument("--report", type=Path, default=ROOT / "docs/benchmark-probe-overhead.md")
    parser.add_argument(
        "--from-json", type=Path, help="re-summarise a results file (no engines), then write"
    )
    args = parser.parse_args()
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        for row in result["rows"]:  # same formulas on the raw run times
            probe_ms = row["probe_ms_per_request"]
            row.update(
                summarise(
                    row["prompt_tokens"],
                    row["batch"],
                    row["all_seconds"],
                    [],
                    row["tokens_per_run"],
                )
            )
            row["probe_ms_per_request"] = probe_ms
        write(args, result)
        print(markdown(result))
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    result = benchmark(args)
    write(args, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
