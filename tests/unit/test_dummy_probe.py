"""The GPU benchmarks' dummy probe in its ``shipped`` layout reads what the shipped SmolLM2
config of its kind reads (checked against the files in model_configs/): the same number of
heads on each layer, the same read-outs over the same number of coordinates (the token
read-out over the whole stream), at the same relative depth of the dummy shape; the ``stress``
layout is the 128-head probe the GPU issue was first measured with."""

from __future__ import annotations

from collections import Counter

import pytest

from guardrail.probe.config import load_model_config
from guardrail.testing.dummy_models import DUMMY_SHAPES, dummy_probe_config

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("shape", sorted(DUMMY_SHAPES))
@pytest.mark.parametrize("kind", ["attention", "combined"])
def test_the_shipped_layout_reads_what_the_shipped_config_reads(shape: str, kind: str) -> None:
    shipped = load_model_config(SMOLLM2, "combined" if kind == "combined" else None)
    dummy = dummy_probe_config(shape, kind)  # type: ignore[arg-type]
    layers = DUMMY_SHAPES[shape]["num_hidden_layers"]
    hidden = DUMMY_SHAPES[shape]["hidden_size"]
    dummy.check_fits(layers, 32)
    assert shipped.num_layers is not None and shipped.hidden_size is not None

    def depth(layer: int, of: int) -> float:
        return layer / of

    per_layer = Counter(layer for layer, _ in shipped.heads)
    dummy_per_layer = Counter(layer for layer, _ in dummy.heads)
    assert sorted(dummy_per_layer.values()) == sorted(per_layer.values())
    for (a, count), (b, dummy_count) in zip(
        sorted(per_layer.items()), sorted(dummy_per_layer.items()), strict=True
    ):
        assert count == dummy_count
        assert abs(depth(a, shipped.num_layers) - depth(b, layers)) <= 0.5 / layers
    reads = [
        (p.position, len(p.dims) if len(p.dims) < shipped.hidden_size else "all", p.top_k)
        for p in shipped.hidden or []
    ]
    dummy_reads = [
        (p.position, len(p.dims) if len(p.dims) < hidden else "all", p.top_k)
        for p in dummy.hidden or []
    ]
    assert dummy_reads == reads
    for p, q in zip(shipped.hidden or [], dummy.hidden or [], strict=True):
        assert abs(depth(p.layer, shipped.num_layers) - depth(q.layer, layers)) <= 0.5 / layers


def test_the_stress_layout_is_128_heads_on_16_layers() -> None:
    for shape in DUMMY_SHAPES:
        config = dummy_probe_config(shape, "combined", "stress")
        assert len(config.heads) == 128
        assert set(Counter(layer for layer, _ in config.heads).values()) == {8}
        assert [(p.position, len(p.dims)) for p in config.hidden or []] == [
            ("last", 64),
            ("data_mean", 64),
        ]
