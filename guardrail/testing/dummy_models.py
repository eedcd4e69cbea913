"""Model directories of real Llama shapes with no weights, for timing on a GPU.

vLLM's ``load_format="dummy"`` fills a model of any shape with random weights at start, so only
a ``config.json`` (and a tokenizer) has to exist: right for measuring what the guard costs,
useless for detection quality. The tokenizer is the tiny test models' (its ids lie far below the
vocabulary size). ``dummy_probe_config`` is a probe of the size the shipped configs have (128
heads, 8 per layer on 16 layers spread over the model), random weights.

Example:
    >>> path = build_dummy_model("1b", Path("/tmp/dummy"))  # doctest: +SKIP
    >>> LLM(str(path), load_format="dummy")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from guardrail.probe.config import HiddenLayerProbe, ModelProbeConfig
from guardrail.testing.tiny_models import build_tiny_model

__all__ = ["DUMMY_SHAPES", "ProbeKind", "build_dummy_model", "dummy_probe_config"]

DUMMY_SHAPES: dict[str, dict[str, int]] = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336},
}
"""Llama 3.2 1B and Llama 3.1 8B shapes (both with 32 heads and 8 KV heads of size 64/128)."""

ProbeKind = Literal["attention", "combined"]


def build_dummy_model(shape: str, root: Path) -> Path:
    """``root/dummy-<shape>``: a bfloat16 Llama config of ``shape`` and the tiny tokenizer."""
    tiny = build_tiny_model(root / "tiny-llama", arch="llama")
    out = root / f"dummy-{shape}"
    out.mkdir(parents=True, exist_ok=True)
    for name in tiny.iterdir():
        if name.name.startswith(("tokenizer", "chat_template", "special_tokens_map")):
            shutil.copy(name, out / name.name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(DUMMY_SHAPES[shape])
    config.update(
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32768,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        max_position_embeddings=8192,
    )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def dummy_probe_config(shape: str, kind: ProbeKind = "attention") -> ModelProbeConfig:
    """A logistic probe of 128 heads for ``dummy-<shape>``; ``combined`` adds read-outs of 64
    coordinates of the middle layer's stream at the last prompt token and over the data."""
    import numpy as np

    layers = DUMMY_SHAPES[shape]["num_hidden_layers"]
    hidden = DUMMY_SHAPES[shape]["hidden_size"]
    rng = np.random.default_rng(0)
    chosen = sorted(rng.choice(layers, 16, replace=False).tolist())
    heads = [(int(layer), int(h)) for layer in chosen for h in range(0, 32, 4)]
    parts = None
    if kind == "combined":
        dims = sorted(rng.choice(hidden, 64, replace=False).tolist())
        parts = [
            HiddenLayerProbe(
                layer=layers // 2,
                dims=dims,
                mean=[0.0] * 64,
                scale=[1.0] * 64,
                weights=(rng.normal(size=64) * 1e-3).tolist(),
                position=position,
            )
            for position in ("last", "data_mean")
        ]
    return ModelProbeConfig(
        model_id=f"dummy-{shape}",
        probe="logistic",
        feature="attention_stats",
        heads=heads,
        weights=(rng.normal(size=5 * len(heads)) * 1e-2).tolist(),
        bias=0.0,
        hidden=parts,
        threshold=0.5,
    )
