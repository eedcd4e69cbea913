"""The guard's cost on a GPU: guarded engine against plain vLLM, same arguments, same run.

Dummy-weight Llamas (``load_format="dummy"``: random weights of the real shapes, right for timing,
useless for detection) of 1B shape (hidden 2048, 16 layers, 32 heads, 8 kv heads) and 8B shape
(4096, 32, 32, 8), in the model's dtype (bf16). For each shape and engine mode both engines
stay alive (each with part of the GPU's memory) and run alternately on the same prompts: fresh
token ids every round (only a shared system turn is prefix-cached), ``--repeats`` timed rounds
after one warm-up round. The guarded engine renders (instruction, data) pairs and scores every
request; the plain engine gets the same token ids. Early stops are armed (``stop_below``) at a
level no score reaches, so the device-side stop runs on every request and nothing is cut short.

With ``--plain-text`` the plain engine also runs each batch fed the rendered prompts as text
(vLLM tokenizes them, as an application's requests would arrive): the strict reference above
gives plain vLLM token ids, so the guard's own rendering and tokenizing counts against it in
full. With ``--plain-v1`` a further engine, plain vLLM forced onto its V1 model runner, runs
in the same rotation: the guarded engine's logits processor (early stops) makes vLLM fall
back from Model Runner V2 to V1, and this arm shows what that fallback costs by itself.

The probe (``--probe-layouts``): ``shipped`` (the default) is a random-weight config laid out as
the shipped SmolLM2 config of its kind is, at the same relative depths (attention: 42 heads on
5 layers; combined: 6 heads on 3 layers, the stream at the last prompt token of 2 layers, the
data's mean of 1 and the token read-out over the data of 3); ``stress`` is the probe the GPU
issue was first measured with (128 heads, 8 on each of 16 layers; docs/gpu.md's tables before
2026-12-05, seventh session). ``guardrail.testing.dummy_models.dummy_probe_config``.

Reported per (shape, mode, probe kind and layout, prompt length, batch, tokens generated):
median wall time of each engine, throughput ratio guarded/plain, and how many requests came
back unscored (must be 0). With one generated token and batch 1, the wall time is the time to
first token.

Usage (on the GPU machine, ../shared/gpu/README.md):
    python benchmarks/bench_gpu.py --shapes 1b 8b --plain-text --plain-v1 \
        --out benchmarks/results/gpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from guardrail.testing.dummy_models import PROBE_LAYOUTS
from guardrail.testing.timing import requests_of, time_once

ROOT = Path(__file__).resolve().parents[1]


def run_shape(
    args: argparse.Namespace, shape: str, mode: str, kind: str, layout: str, keep: Any
) -> list[dict[str, Any]]:
    """Both engines of one (shape, mode, kind, probe layout), every case; ``keep(row)`` after
    each case."""
    from vllm import LLM

    from guardrail.engine import HookedLLM
    from guardrail.probe.prompts import prepare_prompt
    from guardrail.testing.dummy_models import build_dummy_model, dummy_probe_config

    model = str(build_dummy_model(shape, args.cache))
    engine_args: dict[str, Any] = {
        "load_format": "dummy",
        "dtype": "bfloat16",
        # prompts land within a few % of their target length (fresh numbers every round)
        "max_model_len": int(max(args.lengths) * 1.15) + max(args.max_tokens) + 64,
        "gpu_memory_utilization": args.memory,
        "seed": 0,
        "enforce_eager": mode == "eager",
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    guarded = HookedLLM(model, dummy_probe_config(shape, kind, layout), **engine_args)
    engines: dict[str, Any] = {"guarded": guarded, "plain": LLM(model, **engine_args)}
    if args.plain_text:  # the same engine, fed text: the tokenization an application pays anyway
        engines["plain_text"] = engines["plain"]
    if args.plain_v1:  # the guarded engine runs vLLM's V1 model runner (its logits processor)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        try:
            engines["plain_v1"] = LLM(model, **engine_args)
        finally:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    tokenizer = engines["plain"].get_tokenizer()
    rows = []
    cases = [(n, b, t) for n in args.lengths for b in args.batches for t in args.max_tokens]
    for length, batch, max_tokens in tqdm(cases, desc=f"{shape} {mode} {kind} {layout}"):
        walls: dict[str, list[float]] = {name: [] for name in engines}
        unscored = 0
        for repeat in range(args.repeats + 1):
            # fresh prompts for every case and round (the salt includes max_tokens: a case
            # must not find the previous case's prompts in the prefix cache)
            salt = repeat * 100_000 + length * 10 + batch * 1000 + max_tokens
            reqs = requests_of(length, batch, salt=salt, tokenizer=tokenizer)
            prepared = [(r, prepare_prompt(r, tokenizer)) for r in reqs]
            order = list(engines) if repeat % 2 else list(reversed(engines))
            for name in order:
                wall, missing = time_once(engines[name], name, prepared, max_tokens)
                if repeat:
                    walls[name].append(wall)
                    unscored += missing
        plain_s, guarded_s = statistics.median(walls["plain"]), statistics.median(walls["guarded"])
        rows.append(
            {
                "shape": shape,
                "mode": mode,
                "kind": kind,
                "layout": layout,
                "prompt_tokens": len(prepared[0][1].token_ids),
                "batch": batch,
                "max_tokens": max_tokens,
                "plain_s": round(plain_s, 5),
                "guarded_s": round(guarded_s, 5),
                "ratio": round(plain_s / guarded_s, 3),
                **{f"{name}_runs": [round(w, 5) for w in runs] for name, runs in walls.items()},
                "unscored": unscored,
            }
        )
        for name in ("plain_text", "plain_v1"):
            if name in walls:
                median = statistics.median(walls[name])
                rows[-1][f"{name}_s"] = round(median, 5)
                rows[-1][f"ratio_{name.removeprefix('plain_')}"] = round(median / guarded_s, 3)
        print(json.dumps(rows[-1]), flush=True)
        keep(rows[-1])
    guarded.close()
    engines.clear()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=["1b", "8b"])
    parser.add_argument("--modes", nargs="+", default=["compiled"], choices=["compiled", "eager"])
    parser.add_argument(
        "--kinds", nargs="+", default=["attention"], choices=["attention", "combined"]
    )
    parser.add_argument(
        "--probe-layouts", nargs="+", default=["shipped"], choices=list(PROBE_LAYOUTS)
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", type=float, default=0.3, help="GPU memory share per engine")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs per engine (both engines)"
    )
    parser.add_argument(
        "--plain-text",
        action="store_true",
        help="an arm where the plain engine gets each prompt as rendered text (vLLM tokenizes "
        "it), as an application's request would arrive",
    )
    parser.add_argument(
        "--plain-v1",
        action="store_true",
        help="a third arm: plain vLLM on its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0), "
        "the runner the guarded engine falls back to, so the fallback's own cost shows",
    )
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guardrail-bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_h200.json")
    args = parser.parse_args()
    import torch
    import vllm

    import guardrail

    header = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "guardrail": getattr(guardrail, "__version__", "dev"),
        "repeats": args.repeats,
        "tensor_parallel_size": args.tensor_parallel_size,
        "commit": os.environ.get("GUARDRAIL_COMMIT", "unknown"),  # the tree has no .git there
    }
    rows: list[dict[str, Any]] = []

    def keep(row: dict[str, Any]) -> None:  # written after every case: a cut run keeps its rows
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")

    for shape in args.shapes:
        for mode in args.modes:
            for kind in args.kinds:
                for layout in args.probe_layouts:
                    run_shape(args, shape, mode, kind, layout, keep)


if __name__ == "__main__":
    main()
