"""A config's focus computed on the model's device, for every row of a step at once.

The worker decides early stops in the step that scores a request, before its first token is
sampled. Doing that on the host would need the step's stats on the host (a synchronisation in
the middle of the forward pass); this module folds the config into a few tensor operations
instead, so the stop decision stays on the device and reaches the sampler as a tensor.

It computes exactly what :meth:`ModelProbeConfig.focus` computes (float64, same formulas:
``scoring.head_features``, ``scoring.logistic_focus``, ``scoring.mean_focus``); the unit tests
compare the two on random stats for every probe kind and feature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.scoring import EPS, LOG_FLOOR, LOGIT_EPS, HeadKey

__all__ = ["DeviceFocus"]


class DeviceFocus:
    """``config.focus`` over a step's rows: ``stats [rows, heads, 5]`` (columns in ``heads``
    order) and ``terms [rows, layers]`` (hidden-state logit terms, columns in ``term_layers``
    order) -> focus ``[rows]`` float64.

    Example:
        >>> config = ModelProbeConfig(model_id="m", heads=[(0, 1)])
        >>> focus = DeviceFocus(config, [(0, 0), (0, 1)], [], "cpu")
        >>> stats = torch.tensor([[[0.1, 0.1, 0, 0, 0], [0.3, 0.1, 0, 0, 0]]])
        >>> focus(stats, torch.zeros(1, 0)).round(decimals=4).tolist()
        [0.75]
    """

    def __init__(
        self,
        config: ModelProbeConfig,
        heads: Sequence[HeadKey],
        term_layers: Sequence[int],
        device: torch.device | str,
    ) -> None:
        column = {head: i for i, head in enumerate(heads)}
        missing = [h for h in config.heads if h not in column]
        if missing:
            raise ValueError(f"the probe's stats lack the config's heads {missing[:5]}")
        self.columns = torch.tensor([column[h] for h in config.heads], device=device)
        self.logistic = config.probe == "logistic"
        self.feature = config.feature
        self.bias = float(config.bias)
        self.weights = torch.tensor(config.weights or [], dtype=torch.float64, device=device)
        layers = config.hidden_layers
        absent = [layer for layer in layers if layer not in term_layers]
        if absent:
            raise ValueError(f"the probe reads no hidden-state term of layers {absent}")
        self.is_mass = torch.tensor([True] * 4 + [False], device=device)  # of the 5 stats
        self.term_columns = torch.tensor(
            [list(term_layers).index(layer) for layer in layers], dtype=torch.long, device=device
        )

    def __call__(self, stats: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
        s = stats.index_select(1, self.columns).double()  # [rows, config heads, 5]
        if self.logistic and self.feature == "attention_stats":
            # the four masses' logs (floored) and the entropy as it is, in one pass
            features = torch.where(self.is_mass, s.clamp(min=LOG_FLOOR).log(), s).flatten(1)
        else:
            focus = s[..., 0] / (s[..., 0] + s[..., 1] + EPS)
            if not self.logistic:
                return focus.mean(-1)
            if self.feature == "logit_focus":
                clipped = focus.clamp(LOGIT_EPS, 1.0 - LOGIT_EPS)
                features = torch.log(clipped / (1.0 - clipped))
            else:
                features = focus
        z = self.bias + features @ self.weights
        if self.term_columns.numel():
            z = z + terms.index_select(1, self.term_columns).double().sum(-1)
        return 1.0 - torch.sigmoid(z)
