"""What rendering and tokenizing requests costs on the caller (CPU): ``prepare_prompt(s)``.

Every request the guard serves is rendered through the chat template and tokenized by the
caller before vLLM sees it, so this cost is on the critical path (time to first token). This
times ``prepare_prompt`` (batch 1) and ``prepare_prompts`` (batch 64) with the embedded SmolLM2
tokenizer on requests of about 512 and 2,048 prompt tokens, in two forms: an (instruction,
data) pair and a chat message list (system, user, a tool result holding the data, user).
Medians over repeats; results to ``benchmarks/results/bench_render_<commit>.json``.

Beside them, the row ``encode`` times what any caller of vLLM pays for the same text:
``tokenizer.encode(text, add_special_tokens=False)`` of each request's rendered text (vLLM's
renderer makes that one call per text prompt), so the rendering's own cost reads as the
difference.

Usage (``--against``: a checkout of the code to compare with, timed in turn in this process,
so that both see the same load):
    git worktree add /tmp/render_base <commit>
    .venv/bin/python benchmarks/bench_render.py [--repeats 60] [--against /tmp/render_base]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from guardrail.embedded import embedded_model_path
from guardrail.probe import prompts

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "the report says revenue grew in the third quarter while costs fell; customers asked for "
    "faster delivery, clearer invoices and a simpler refund process. Meeting notes: Alice will "
    "draft the plan, Bob checks figures (12.5%, 3,400 units) and Chen emails suppliers by Friday. "
)


def _text(tokenizer: Any, tokens: int, salt: int) -> str:
    """English-like text of about ``tokens`` tokens, different per ``salt``."""
    text = f"Item {salt}. "
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += WORDS
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return str(tokenizer.decode(ids))


def _requests(tokenizer: Any, form: str, tokens: int, count: int) -> list[Any]:
    requests: list[Any] = []
    for salt in range(count):
        data = _text(tokenizer, tokens - 40, salt)
        if form == "pair":
            requests.append((f"Summarize the document in three bullet points ({salt}).", data))
        else:
            requests.append(
                [
                    {"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": f"Look up document {salt} and summarize it."},
                    {"role": "tool", "content": data},
                    {"role": "user", "content": "Three bullet points, please."},
                ]
            )
    return requests


def _timed(run: Callable[[], object]) -> tuple[float, float]:
    """Wall and this thread's CPU milliseconds of one ``run`` (CPU time is less disturbed by the
    other jobs of a shared machine; it misses the encoding threads of a batch, if any run)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    run()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


def _medians(
    modules: dict[str, Any], run: Callable[[Any], object], repeats: int
) -> dict[str, dict[str, float]]:
    """Median wall and CPU ms of ``run(module)`` per module, the modules taking turns."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in modules}
    order = list(modules.items())
    for _ in range(repeats):
        order.reverse()  # each goes first half the time: neither gets the other's warm caches
        for name, module in order:
            times[name].append(_timed(functools.partial(run, module)))
    return {
        name: {
            "wall_ms": round(statistics.median(t[0] for t in pairs), 3),
            "cpu_ms": round(statistics.median(t[1] for t in pairs), 3),
        }
        for name, pairs in times.items()
    }


def _encode(tokenizer: Any, text: str) -> object:
    """The reference: the tokenizer's own encode of a rendered text, as vLLM calls it."""
    return tokenizer.encode(text, add_special_tokens=False)


def _encode_all(tokenizer: Any, texts: list[str]) -> object:
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _load_prompts(root: Path) -> Any:
    """``guardrail/probe/prompts.py`` of another checkout (e.g. a worktree of the commit before
    a change), loaded beside this one so both are timed in turn."""
    path = root / "guardrail" / "probe" / "prompts.py"
    spec = importlib.util.spec_from_file_location("bench_render_baseline_prompts", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no prompts module at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _commit(where: Path) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=60, help="timed runs per case, batch 1")
    parser.add_argument("--against", type=Path, default=None, help="checkout to time in turn")
    parser.add_argument(
        "--encode-threads", type=int, default=None, help="ENCODE_THREADS for both (default: as set)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="its directory (default: the embedded SmolLM2)"
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or embedded_model_path())
    modules = {"this": prompts}
    if args.against is not None:
        modules["against"] = _load_prompts(args.against)
    for module in modules.values():
        if args.encode_threads is not None:
            module.ENCODE_THREADS = args.encode_threads
    rows = []
    for form, tokens in tqdm([(f, t) for t in (512, 2048) for f in ("pair", "chat")]):
        batch = _requests(tokenizer, form, tokens, 64)
        outputs = {n: m.prepare_prompts(batch, tokenizer) for n, m in modules.items()}  # warm
        lengths = [
            len(p.token_ids) for p in outputs["this"] if isinstance(p, prompts.PreparedPrompt)
        ]
        if any(repr(o) != repr(outputs["this"]) for o in outputs.values()):
            raise SystemExit(f"{form} {tokens}: the two checkouts prepared different prompts")
        one, many = batch[0], max(5, args.repeats // 4)
        single = _medians(
            modules, lambda m, one=one: m.prepare_prompt(one, tokenizer), args.repeats
        )
        whole = _medians(modules, lambda m, batch=batch: m.prepare_prompts(batch, tokenizer), many)
        texts = [p.text for p in outputs["this"] if isinstance(p, prompts.PreparedPrompt)]
        single |= _medians(
            {"encode": texts[0]}, functools.partial(_encode, tokenizer), args.repeats
        )
        whole |= _medians({"encode": texts}, functools.partial(_encode_all, tokenizer), many)
        for name in [*modules, "encode"]:
            rows.append(
                {
                    "code": name,
                    "form": form,
                    "tokens": int(statistics.median(lengths)),
                    "batch1_ms": single[name],
                    "batch64_ms": whole[name],
                }
            )
    commit = _commit(Path(prompts.__file__).resolve().parent)
    result = {
        "commit": commit,
        "against": None if args.against is None else _commit(args.against),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, shared with other jobs",
        "encode_threads": prompts.ENCODE_THREADS,
        "repeats": args.repeats,
        "rows": rows,
    }
    threads = "" if args.encode_threads is None else f"_threads{args.encode_threads}"
    out = args.out or ROOT / "benchmarks" / "results" / f"bench_render_{commit}{threads}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"commit {commit} (against: {result['against']}); medians, ms; written to {out}")
    print(
        f"{'code':<8}{'form':<6}{'tokens':>7}{'b1 wall':>9}{'b1 cpu':>9}"
        f"{'b64 wall':>10}{'b64 cpu':>9}"
    )
    for row in rows:
        b1, b64 = row["batch1_ms"], row["batch64_ms"]
        print(
            f"{row['code']:<8}{row['form']:<6}{row['tokens']:>7}{b1['wall_ms']:>9.3f}"
            f"{b1['cpu_ms']:>9.3f}{b64['wall_ms']:>10.2f}{b64['cpu_ms']:>9.2f}"
        )


if __name__ == "__main__":
    main()
