"""The worker's device focus (early stops) against ``ModelProbeConfig.focus``, the host's."""

from __future__ import annotations

import pytest
import torch

from guardrail.probe.config import HiddenLayerProbe, ModelProbeConfig
from guardrail.probe.device_focus import DeviceFocus
from guardrail.probe.scoring import FEATURES_PER_HEAD

TABLE_HEADS = [(1, 0), (1, 3), (2, 1), (4, 2), (4, 0)]  # the worker's column order


def _stats(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    masses = torch.rand(rows, len(TABLE_HEADS), 4, generator=g) ** 3  # some near 0
    entropy = torch.rand(rows, len(TABLE_HEADS), 1, generator=g)
    return torch.cat([masses, entropy], dim=-1).float()


def _config(probe: str, feature: str, hidden: bool) -> ModelProbeConfig:
    heads = [(4, 2), (1, 0), (2, 1)]  # not in table order, one table head unused
    weights = None
    if probe == "logistic":
        n = FEATURES_PER_HEAD[feature] * len(heads)
        weights = torch.linspace(-2.0, 1.5, n).tolist()
    parts = None
    if hidden:
        parts = [
            HiddenLayerProbe(layer=3, dims=[0], mean=[0.0], scale=[1.0], weights=[1.0]),
            HiddenLayerProbe(
                layer=3, dims=[1], mean=[0.0], scale=[1.0], weights=[1.0], position="data_mean"
            ),
            HiddenLayerProbe(layer=7, dims=[2], mean=[0.0], scale=[1.0], weights=[1.0]),
        ]
    return ModelProbeConfig(
        model_id="m",
        probe=probe,
        heads=heads,
        weights=weights,
        bias=0.3 if probe == "logistic" else 0.0,
        feature=feature,
        hidden=parts,
    )


@pytest.mark.parametrize(
    ("probe", "feature", "hidden"),
    [
        ("mean_focus", "focus", False),
        ("logistic", "focus", False),
        ("logistic", "logit_focus", False),
        ("logistic", "attention_stats", False),
        ("logistic", "attention_stats", True),
    ],
)
def test_device_focus_equals_the_configs_focus(probe, feature, hidden):
    config = _config(probe, feature, hidden)
    stats = _stats(6, seed=len(feature))
    term_layers = [3, 5, 7]  # the worker's term columns; layer 5 is read but not by the config
    terms = torch.randn(6, len(term_layers), generator=torch.Generator().manual_seed(9))
    got = DeviceFocus(config, TABLE_HEADS, term_layers, "cpu")(stats, terms)
    for r in range(6):
        per_head = {h: stats[r, j].tolist() for j, h in enumerate(TABLE_HEADS)}
        hidden_terms = {lay: float(terms[r, j]) for j, lay in enumerate(term_layers)}
        want = config.focus(per_head, hidden_terms if hidden else None)
        assert got[r].item() == pytest.approx(want, abs=1e-12)


def test_device_focus_refuses_a_table_without_the_configs_heads():
    config = _config("mean_focus", "focus", False)
    with pytest.raises(ValueError, match="lack the config's heads"):
        DeviceFocus(config, TABLE_HEADS[:2], [], "cpu")
