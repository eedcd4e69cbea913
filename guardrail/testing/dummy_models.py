"""Model directories of real Llama shapes with no weights, for timing on a GPU.

vLLM's ``load_format="dummy"`` fills a model of any shape with random weights at start, so only
a ``config.json`` (and a tokenizer) has to exist: right for measuring what the guard costs,
useless for detection quality. The tokenizer is the tiny test models' (its ids lie far below the
vocabulary size). ``dummy_probe_config`` is a probe with random weights, laid out as the shipped
SmolLM2 config of the same kind is (``shipped``: the same heads per layer and read-outs, at the
same relative depths, each read-out over the same number of coordinates or the whole stream),
or as the GPU issue first measured it (``stress``: 128 heads, 8 on each of 16 layers).

Example:
    >>> path = build_dummy_model("1b", Path("/tmp/dummy"))  # doctest: +SKIP
    >>> LLM(str(path), load_format="dummy")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from guardrail.probe.config import HiddenLayerProbe, HiddenPosition, ModelProbeConfig
from guardrail.testing.tiny_models import build_tiny_model

__all__ = [
    "DUMMY_SHAPES",
    "PROBE_LAYOUTS",
    "ProbeKind",
    "ProbeLayout",
    "build_dummy_model",
    "dummy_probe_config",
]

DUMMY_SHAPES: dict[str, dict[str, int]] = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336},
}
"""Llama 3.2 1B and Llama 3.1 8B shapes (both with 32 heads and 8 KV heads of size 64/128)."""

ProbeKind = Literal["attention", "combined"]
ProbeLayout = Literal["shipped", "stress"]
PROBE_LAYOUTS: tuple[ProbeLayout, ...] = ("shipped", "stress")

SHIPPED_DEPTH = 30
"""The decoder layers of the model the shipped configs were calibrated on (SmolLM2-135M)."""
SHIPPED_HEADS: dict[ProbeKind, dict[int, int]] = {
    "attention": {7: 7, 14: 9, 15: 8, 17: 9, 21: 9},
    "combined": {14: 2, 15: 3, 17: 1},
}
"""Heads per layer of the shipped SmolLM2 configs (``model_configs/``), by kind."""
SHIPPED_HIDDEN: tuple[tuple[int, HiddenPosition, int | None], ...] = (
    (15, "last", 10),
    (18, "last", 10),
    (15, "data_mean", 24),
    (15, "data_top", None),
    (18, "data_top", None),
    (21, "data_top", None),
)
"""The shipped combined config's hidden read-outs: (layer, position, coordinates; None: the
whole stream, the token read-out's model), its token read-out's ``top_k`` being 10."""
SHIPPED_TOP_K = 10


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


def _scaled(layer: int, layers: int) -> int:
    """The layer at the same relative depth of a model of ``layers`` decoder layers."""
    return min(layers - 1, round(layer * layers / SHIPPED_DEPTH))


def dummy_probe_config(
    shape: str, kind: ProbeKind = "attention", layout: ProbeLayout = "shipped"
) -> ModelProbeConfig:
    """A probe with random weights for ``dummy-<shape>`` (module docstring). ``shipped``: the
    heads and read-outs of the shipped SmolLM2 config of ``kind`` moved to the same relative
    depths (``attention``: 42 heads on 5 layers; ``combined``: 6 heads on 3 layers, the stream
    at the last prompt token of 2 layers, the data's mean stream of 1 and a token read-out over
    the data of 3, whole streams). ``stress``: 128 heads, 8 on each of 16 layers, and for
    ``combined`` 64 coordinates of the middle layer's stream at the last prompt token and over
    the data.

    Example:
        >>> config = dummy_probe_config("1b", "combined")
        >>> sorted({layer for layer, _ in config.heads}), len(config.heads)
        ([7, 8, 9], 6)
        >>> [(p.layer, p.position, len(p.dims)) for p in config.hidden][-1]
        (11, 'data_top', 2048)
    """
    import numpy as np

    layers = DUMMY_SHAPES[shape]["num_hidden_layers"]
    hidden = DUMMY_SHAPES[shape]["hidden_size"]
    rng = np.random.default_rng(0)
    parts: list[HiddenLayerProbe] | None = None
    if layout == "stress":
        chosen = sorted(rng.choice(layers, 16, replace=False).tolist())
        heads = [(int(layer), int(h)) for layer in chosen for h in range(0, 32, 4)]
        stress: tuple[HiddenPosition, ...] = ("last", "data_mean") if kind == "combined" else ()
        reads = [(layers // 2, position, 64) for position in stress]
    else:
        heads = [
            (_scaled(layer, layers), int(h))
            for layer, count in SHIPPED_HEADS[kind].items()
            for h in sorted(rng.choice(32, count, replace=False).tolist())
        ]
        reads = (
            [(_scaled(layer, layers), p, n or hidden) for layer, p, n in SHIPPED_HIDDEN]
            if kind == "combined"
            else []
        )
    if reads:
        parts = []
        # the stress layout's two read-outs share their coordinates (as first measured)
        shared = rng.choice(hidden, 64, replace=False).tolist() if layout == "stress" else None
        for layer, position, count in reads:
            drawn = shared if shared is not None else rng.choice(hidden, count, replace=False)
            dims = sorted(int(d) for d in drawn)
            parts.append(
                HiddenLayerProbe(
                    layer=layer,
                    dims=dims,
                    mean=[0.0] * count,
                    scale=[1.0] * count,
                    weights=(rng.normal(size=count) * 1e-3).tolist(),
                    position=position,
                    top_k=SHIPPED_TOP_K if position == "data_top" else None,
                )
            )
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
