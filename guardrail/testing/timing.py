"""Requests and timing shared by the GPU cost benchmarks (``benchmarks/bench_gpu.py``,
``profile_gpu.py``, ``profile_phases.py``, ``count_probe_ops.py``): prompts of a chosen length,
new for every salt so the prefix cache holds only the shared system turn, and one timed batch
through a guarded or a plain engine.

Example:
    >>> reqs = requests_of(512, 64, salt=1, tokenizer=tok)  # doctest: +SKIP
    >>> wall, unscored = time_once(guarded, "guarded", prepared, max_tokens=1)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["SYSTEM", "requests_of", "time_once"]

SYSTEM = "You are a careful assistant. Answer only from the document, in one sentence."


def requests_of(length: int, batch: int, salt: int, tokenizer: Any) -> list[tuple[str, str]]:
    """``batch`` (instruction, data) pairs of about ``length`` prompt tokens, new every salt."""
    from guardrail.probe.prompts import prepare_prompt

    words = "invoice paid supplier order shipment customer report meeting budget sales".split()

    def data(b: int, n: int) -> str:
        return " ".join(
            f"{words[(salt + b + i) % len(words)]} {(salt * 7 + b * 13 + i) % 997}"
            for i in range(n)
        )

    lo, hi = 1, length
    while lo < hi:  # fewest words that reach the target length
        mid = (lo + hi) // 2
        if len(prepare_prompt((SYSTEM, data(0, mid)), tokenizer).token_ids) < length:
            lo = mid + 1
        else:
            hi = mid
    return [(SYSTEM, data(b, lo)) for b in range(batch)]


def time_once(engine: Any, arm: str, prepared: list[Any], max_tokens: int) -> tuple[float, int]:
    """Wall time of one batch, and how many requests came back without a score. ``prepared``:
    (request, its rendered prompt) pairs; the plain arms get the prompt's token ids, or with
    ``plain_text`` its rendered text (vLLM tokenizes it, as an application's request would)."""
    from vllm import SamplingParams
    from vllm.inputs import TextPrompt, TokensPrompt

    guarded = arm == "guarded"

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if guarded:
        start = time.perf_counter()
        outs = engine.generate([p[0] for p in prepared], params, stop_below=-1.0)
        wall = time.perf_counter() - start
        failed = [
            o.error or (o.probe.error if o.probe else None) or "no score"
            for o in outs
            if o.error is not None or o.probe is None or o.probe.error or o.probe.focus is None
        ]
        if failed:
            print(f"unscored: {len(failed)}, e.g. {failed[0]}", flush=True)
        return wall, len(failed)
    # plain_text shares the plain engine: its own cache salt keeps it off the plain arm's cache
    prompts: list[Any] = [
        TextPrompt(prompt=p[1].text, cache_salt="plain_text")
        if arm == "plain_text"
        else TokensPrompt(prompt_token_ids=p[1].token_ids)
        for p in prepared
    ]
    start = time.perf_counter()
    engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, 0
