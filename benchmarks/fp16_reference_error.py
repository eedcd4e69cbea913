"""How far Hugging Face's own float16 run is from its float32 run on the GPU tests' model: the
floor under any float16 parity tolerance (tests/gpu/test_gpu_engine.py cites these numbers).

For each query/key init std, the tiny float16 Llama of the GPU tests (hidden 256, head size 64,
4 layers) runs the 18 requests of ``tests.helpers.mixed_batch`` in HF eager attention on the
CPU, in float16 and in float32; printed: the largest difference of the four attention masses
(instruction, data, sink, largest data token) over every head, and the largest relative L2
error of the residual stream at the last token (layers 0-2).

Usage:
    .venv/bin/python benchmarks/fp16_reference_error.py --stds 0.2 0.1 0.05
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine.test_hidden_state import hf_streams  # noqa: E402
from tests.gpu.test_gpu_engine import SHAPE  # noqa: E402
from tests.helpers import hf_head_stats, mixed_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stds", type=float, nargs="+", default=[0.2, 0.1, 0.05])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guardrail-fp16"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from guardrail.probe.prompts import prepare_prompt
    from guardrail.testing.tiny_models import build_tiny_model

    heads = [(layer, head) for layer in range(4) for head in range(4)]
    for std in args.stds:
        model = build_tiny_model(args.cache / f"qk{std}", overrides=SHAPE, qk_std=std)
        tokenizer = AutoTokenizer.from_pretrained(model)
        worst_stat = worst_stream = 0.0
        for request in tqdm(mixed_batch(), desc=f"qk std {std}"):
            p = prepare_prompt(request, tokenizer)
            spans = (p.instruction_spans, p.data_spans)
            half = hf_head_stats(str(model), p.token_ids, *spans, heads, dtype=torch.float16)
            full = hf_head_stats(str(model), p.token_ids, *spans, heads, dtype=torch.float32)
            for head in heads:
                diffs = [abs(a - b) for a, b in zip(half[head][:4], full[head][:4], strict=True)]
                worst_stat = max(worst_stat, *diffs)
            data = tuple(tuple(s) for s in p.data_spans)
            last16, _ = hf_streams(str(model), tuple(p.token_ids), data, torch.float16, "cpu")
            last32, _ = hf_streams(str(model), tuple(p.token_ids), data, torch.float32, "cpu")
            for layer in (0, 1, 2):
                want = np.asarray(last32[layer])
                error = np.linalg.norm(np.asarray(last16[layer]) - want) / np.linalg.norm(want)
                worst_stream = max(worst_stream, float(error))
        print(f"qk std {std}: stats {worst_stat:.3g}, stream {100 * worst_stream:.3g} %")


if __name__ == "__main__":
    main()
