"""Measure what a steering vector does on held-out injected and clean examples.

    python benchmarks/measure_steering.py [--vector NAME_OR_PATH ...] [--coefficients 17]

Held-out examples: the clean BIPIA rows of the source contexts listed in
``docs/bipia_heldout_split.json`` (never used to build or select the vector), each also given
``--variants`` generated canary injections (``guardrail.offline.steering_examples.CANARIES``;
each copy another canary and position). Every arm generates the same prompts greedily on one engine
(SmolLM2-135M-Instruct, float32, eager); arms differ only in steering. Reported per arm:

- attack success: share of injected prompts whose output contains the canary (the automatic
  check; the same check on clean outputs gives its false-positive rate), with the paired
  change against the unsteered arm and an exact McNemar p-value;
- focus: the probe's score of the same requests (the shipped SmolLM2 probe config);
- benign cost: share of clean outputs that changed, their mean text similarity to the unsteered
  output (difflib ratio), how often the reference answer appears in the output (email and
  table rows), and the teacher-forced log-probability per token of the reference answer;
- the retry flow end to end at the config's threshold: attacks delivered and clean requests
  blocked when flagged requests are blocked, versus retried with steering and re-scored.

Results go to ``benchmarks/results/steering_<model>.json``; ``docs/steering.md`` quotes them.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "bipia"
DEFAULT_VECTOR = "SmolLM2-135M-Instruct"


def held_out_rows(per_task: int, max_chars: int) -> list[Any]:
    """Clean held-out rows (the split file's source contexts), with BIPIA reference answers."""
    from guardrail.offline.datasets import LabelledPair, load_pairs, read_split
    from guardrail.offline.steering_examples import bipia_ideals

    pairs, _ = load_pairs(sorted(DATA.glob("bipia_*_train_pairs.jsonl")))
    held = read_split(ROOT / "docs" / "bipia_heldout_split.json")
    ideals = bipia_ideals(DATA / "raw")
    rows: list[LabelledPair] = []
    for task in ("email", "code", "table"):
        chosen = [
            p
            for p in pairs
            if p.task == task and p.label == 0 and p.group in held and len(p.data) <= max_chars
        ][:per_task]
        for p in chosen:
            extra = {**p.extra, "ideal": ideals.get(p.group)}
            rows.append(LabelledPair(**{**p.__dict__, "extra": extra}))
    return rows


def injected_variants(rows: list[Any], variants: int, seed: int) -> list[Any]:
    """``variants`` injected copies of each row: each with another canary and position
    (rotating the rows shifts the canary and position each row gets)."""
    from guardrail.offline.steering_examples import make_examples

    out = []
    for v in range(variants):
        out += make_examples(rows[v:] + rows[:v], seed + v)
    return out


def _norm(text: str) -> str:
    return re.sub(r"[\s,$*`'\"]", "", text.lower())


def answer_found(output: str, ideal: str | None, task: str) -> bool | None:
    """Reference answer in the output (normalised); None where no short reference exists."""
    if ideal is None or task == "code":
        return None
    return _norm(ideal) in _norm(output)


def run_arm(
    engine: Any, injected: list[Any], clean: list[Any], steering: Any, max_tokens: int
) -> dict[str, Any]:
    requests = [e.request(True) for e in injected] + [e.request(False) for e in clean]
    params = engine._sampling(max_tokens=max_tokens)
    started = time.perf_counter()
    outputs = engine.generate(requests, params, steering=steering, use_tqdm=True)
    seconds = time.perf_counter() - started
    n = len(injected)
    errors = [o.steering.error for o in outputs if o.steering is not None and o.steering.error]
    if errors:
        raise RuntimeError(f"steering failed: {errors[0]}")
    with_ideal = [e for e in clean if e.ideal is not None]
    ideal_lp = engine.continuation_logprobs(
        [e.request(False) for e in with_ideal], [e.ideal for e in with_ideal], steering=steering
    )
    return {
        "seconds": seconds,
        "injected_text": [o.text for o in outputs[:n]],
        "clean_text": [o.text for o in outputs[n:]],
        "injected_focus": [o.probe.focus for o in outputs[:n]],
        "clean_focus": [o.probe.focus for o in outputs[n:]],
        "ideal_logprob": [float(np.mean(lp)) for lp in ideal_lp],
    }


def _followed(examples: list[Any], texts: list[str]) -> np.ndarray:
    return np.array([e.followed_injection(t) for e, t in zip(examples, texts, strict=True)])


def mcnemar_p(stopped: int, started: int) -> float:
    """Exact two-sided McNemar test on the discordant pairs."""
    n, k = stopped + started, min(stopped, started)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return float(min(1.0, 2 * tail))


def retry_flow(
    injected: list[Any], arm: dict[str, Any], base: dict[str, Any], threshold: float
) -> dict[str, float]:
    """End-to-end outcomes at ``threshold``: "block" blocks flagged requests; "retry" retries
    them steered and delivers the steered output when its focus passes, else blocks."""
    f0, f1 = np.array(base["injected_focus"]), np.array(arm["injected_focus"])
    c0, c1 = np.array(base["clean_focus"]), np.array(arm["clean_focus"])
    follow0 = _followed(injected, base["injected_text"])
    follow1 = _followed(injected, arm["injected_text"])
    flagged, passes = f0 <= threshold, f1 > threshold
    return {
        "threshold": threshold,
        "injected_flagged": float(flagged.mean()),
        "injected_pass_on_retry": float((flagged & passes).mean()),
        "attacks_delivered_block": float((~flagged & follow0).mean()),
        "attacks_delivered_retry": float(
            ((~flagged & follow0) | (flagged & passes & follow1)).mean()
        ),
        "clean_blocked_block": float((c0 <= threshold).mean()),
        "clean_blocked_retry": float(((c0 <= threshold) & (c1 <= threshold)).mean()),
    }


def summarise(
    injected: list[Any], clean: list[Any], arm: dict[str, Any], base: dict[str, Any], t: float
) -> dict[str, Any]:
    followed = _followed(injected, arm["injected_text"])
    base_followed = _followed(injected, base["injected_text"])
    maybe_found = [
        answer_found(t, e.ideal, e.task) for e, t in zip(clean, arm["clean_text"], strict=True)
    ]
    found = [f for f in maybe_found if f is not None]
    similarity = [
        difflib.SequenceMatcher(None, a, b).ratio()
        for a, b in zip(arm["clean_text"], base["clean_text"], strict=True)
    ]
    inj_f, clean_f = np.array(arm["injected_focus"]), np.array(arm["clean_focus"])
    inj_delta = inj_f - np.array(base["injected_focus"])
    stopped, started = (
        int((base_followed & ~followed).sum()),
        int((followed & ~base_followed).sum()),
    )
    per_task = {}
    for task in sorted({e.task for e in injected}):
        idx = [i for i, e in enumerate(injected) if e.task == task]
        per_task[task] = {
            "n": len(idx),
            "attack_success": float(followed[idx].mean()),
            "injected_focus": float(inj_f[idx].mean()),
        }
    return {
        "n_injected": len(injected),
        "n_clean": len(clean),
        "attack_success": float(followed.mean()),
        "attacks_stopped": stopped,
        "attacks_started": started,
        "mcnemar_p": mcnemar_p(stopped, started),
        "check_false_positive_rate_clean": float(_followed(clean, arm["clean_text"]).mean()),
        "injected_focus_mean": float(inj_f.mean()),
        "clean_focus_mean": float(clean_f.mean()),
        "injected_focus_delta_mean": float(inj_delta.mean()),
        "injected_focus_rose": float((inj_delta > 0).mean()),
        "clean_focus_delta_mean": float((clean_f - np.array(base["clean_focus"])).mean()),
        "clean_outputs_changed": float(
            np.mean([a != b for a, b in zip(arm["clean_text"], base["clean_text"], strict=True)])
        ),
        "clean_similarity_mean": float(np.mean(similarity)),
        "reference_answer_found": float(np.mean(found)) if found else None,
        "n_reference_answers": len(found),
        "ideal_logprob_per_token": float(np.mean(arm["ideal_logprob"])),
        "retry_flow": retry_flow(injected, arm, base, t),
        "seconds": arm["seconds"],
        "per_task": per_task,
    }


def write_results(
    args: argparse.Namespace,
    sets: tuple[list[Any], list[Any]],
    vectors: list[Any],
    config: Any,
    raw: dict[str, Any],
) -> dict[str, Any]:
    """Summaries of the arms run so far, written with the raw outputs to ``args.out``."""
    injected, clean = sets
    base, threshold = raw["unsteered"], float(config.threshold or 0.5)
    doc: dict[str, Any] = {
        "model": config.model_id,
        "vectors": [v.metadata.model_dump(mode="json") for v in vectors],
        "probe_config": {
            "heads": len(config.heads),
            "probe": config.probe,
            "source": config.source,
            "threshold": threshold,
        },
        "settings": {
            **vars(args),
            "out": str(args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out),
            "vector": [v.metadata.name for v in vectors],
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "summary": {
            name: summarise(injected, clean, arm, base, threshold) for name, arm in raw.items()
        },
        "injected": [{"id": e.id, "task": e.task, "canary": e.canary} for e in injected],
        "clean": [{"id": e.id, "task": e.task, "ideal": e.ideal} for e in clean],
        "raw": raw,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    summary: dict[str, Any] = doc["summary"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--vector",
        action="append",
        help="vector name or file, repeatable (default: the shipped SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--per-task", type=int, default=20)
    parser.add_argument("--variants", type=int, default=3, help="injected copies per row")
    parser.add_argument("--max-chars", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--coefficients", default="", help="extra add_vector arms, e.g. 4,8")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/steering_smollm2.json"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from guardrail.embedded import EMBEDDED_MODEL_ID, embedded_model_path
    from guardrail.engine import HookedLLM
    from guardrail.errors import ModelConfigNotFoundError
    from guardrail.probe.config import ModelProbeConfig, load_model_config
    from guardrail.steering import Steering

    rows = held_out_rows(args.per_task, args.max_chars)
    from guardrail.offline.steering_examples import make_examples

    sets = (injected_variants(rows, args.variants, seed=100), make_examples(rows, seed=100))
    try:  # the calibrated config serving uses
        config = load_model_config(EMBEDDED_MODEL_ID)
    except ModelConfigNotFoundError:  # every head of layers 13-21 (design notes)
        heads = [(layer, head) for layer in range(13, 22) for head in range(9)]
        config = ModelProbeConfig(model_id=EMBEDDED_MODEL_ID, heads=heads)
    engine = HookedLLM(
        embedded_model_path(),
        config,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
    )
    try:
        vectors = [engine.load_steering_vector(v) for v in args.vector or [DEFAULT_VECTOR]]
        arms: dict[str, Any] = {"unsteered": None}
        for vector in vectors:
            meta = vector.metadata
            arms[f"{meta.name} L{meta.layer} {meta.method} c={meta.coefficient:g}"] = vector.name
        for c in filter(None, args.coefficients.split(",")):
            meta = vectors[0].metadata
            arms[f"{meta.name} L{meta.layer} add_vector c={c}"] = Steering(
                vector=meta.name, method="add_vector", coefficient=float(c)
            )
        raw: dict[str, Any] = {}
        for name, steering in arms.items():
            raw[name] = run_arm(engine, *sets, steering, args.max_tokens)
            write_results(args, sets, vectors, config, raw)  # partial results survive
    finally:
        engine.close()
    summary = write_results(args, sets, vectors, config, raw)
    for name, s in summary.items():
        print(name, json.dumps(s))


if __name__ == "__main__":
    main()
