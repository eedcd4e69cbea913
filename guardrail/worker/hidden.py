"""The hidden-state signal inside vLLM's worker: the residual stream at the last prompt token.

A forward hook on each decoder layer the config reads (``ModelProbeConfig.hidden``) takes the
stream at the last prompt token of the rows the attention probe scores in this step (the layer
returns ``(hidden, residual)``; the stream is their sum, before the final norm) and computes the
layer's term of the probe's logit on the device: ``sum(weights * (x[dims] - mean) / scale)``.
Layers asked for by calibration (``raw_layers``) also keep the whole stream. The hooks share the
attention probe's plan and rows (``guardrail.worker.probe.Probe``), so both signals come from
the same pass and the same rows, and the step's results are stored once.

The last prompt token is always computed in the step that scores the request (vLLM never serves
it from the prefix cache), so cached prefixes and chunked prefill change nothing here. Python
forward hooks run only in eager mode: a config with a hidden part needs ``enforce_eager=True``
(refused at install otherwise). With tensor parallelism the stream between layers is the same
on every rank; with pipeline parallelism each stage reads the layers it holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from guardrail.probe.config import HiddenLayerProbe, ModelProbeConfig
from guardrail.worker.forward import decoder_layers, step_metadata

__all__ = ["HiddenReader", "install_hidden", "make_hidden_hook"]


@dataclass
class HiddenReader:
    """One decoder layer whose residual stream the probe reads at the last prompt token."""

    index: int
    part: HiddenLayerProbe | None  # the config's read-out (None: raw stream only)
    raw: bool  # return the whole stream (calibration)
    handle: Any = None  # RemovableHandle of the forward hook
    dims: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def to(self, device: Any) -> HiddenReader:
        if self.part is not None:
            p = self.part
            self.dims = torch.tensor(p.dims, dtype=torch.long, device=device)
            self.mean = torch.tensor(p.mean, dtype=torch.float32, device=device)
            self.scale = torch.tensor(p.scale, dtype=torch.float32, device=device)
            self.weights = torch.tensor(p.weights, dtype=torch.float32, device=device)
        return self

    def read(
        self, rows: Sequence[Any], hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        """Each row's logit term (and raw stream), from the layer's output, kept on the device."""
        ok = [r for r in rows if r.error is None]
        if not ok:
            return
        index = torch.tensor([r.token_row for r in ok], device=hidden.device)
        stream = hidden.index_select(0, index)
        if residual is not None:
            stream = stream + residual.index_select(0, index)
        stream = stream.float()
        if self.part is not None:
            assert self.dims is not None and self.mean is not None
            assert self.scale is not None and self.weights is not None
            terms = ((stream.index_select(1, self.dims) - self.mean) / self.scale) @ self.weights
            for r, term in zip(ok, terms, strict=True):
                r.hidden[self.index] = term
        if self.raw:
            for r, x in zip(ok, stream, strict=True):
                r.streams[self.index] = x


def make_hidden_hook(probe: Any, reader: HiddenReader, runner: Any) -> Any:
    """The forward hook of one decoder layer read by the probe; never raises into the engine."""
    from vllm.forward_context import get_forward_context

    def hook(module: Any, args: Any, output: Any) -> None:
        started = time.perf_counter()
        try:
            context = get_forward_context()
            metadata = step_metadata(context)
            if metadata is None:  # warm-up, profiling
                return
            if probe.plan(runner, context, metadata):
                hidden, residual = output if isinstance(output, tuple) else (output, None)
                reader.read(probe.rows, hidden, residual)
        except Exception as exc:  # recorded for the step's rows
            for row in probe.rows:
                row.error = row.error or f"hidden layer {reader.index}: {type(exc).__name__}: {exc}"
        probe.probe_seconds += time.perf_counter() - started
        if probe.rows and probe.finish_on_hidden and reader.index == probe.last_layer:
            probe.finish_step()

    return hook


def install_hidden(
    probe: Any,
    runner: Any,
    info: dict[str, Any],
    config: ModelProbeConfig | None,
    raw_layers: list[int],
) -> None:
    """Hook the decoder layers of ``config.hidden`` and ``raw_layers`` (whole streams returned)
    for ``probe`` (a ``guardrail.worker.probe.Probe``); its step then finishes after the last
    of its attention layers and these."""
    parts = {p.layer: p for p in (config.hidden if config is not None else None) or []}
    wanted = sorted(set(parts) | set(raw_layers))
    if not wanted:
        return
    if not info["enforce_eager"]:
        raise ValueError(
            "the hidden-state signal needs an engine started with enforce_eager=True: in "
            "compiled mode the decoder layers run inside a captured graph where its hooks "
            "never fire (or use an attention-only config)"
        )
    layers = decoder_layers(runner)
    if layers is None:
        raise ValueError(
            f"{type(runner.model).__name__} has no model.layers: the hidden-state signal "
            "cannot read this model; use an attention-only config"
        )
    for index in wanted:
        if not 0 <= index < len(layers):
            raise ValueError(f"hidden layer {index} outside the model's {len(layers)} layers")
        part = parts.get(index)
        if part is not None and max(part.dims) >= info["hidden_size"]:
            raise ValueError(
                f"hidden layer {index} reads coordinate {max(part.dims)}, outside the "
                f"model's hidden size {info['hidden_size']}"
            )
    # With pipeline parallelism a stage holds some layers only (the others are placeholders).
    held = [i for i in wanted if type(layers[i]).__name__ != "PPMissingLayer"]
    for index in held:
        reader = HiddenReader(index, parts.get(index), index in raw_layers).to(runner.device)
        reader.handle = layers[index].register_forward_hook(make_hidden_hook(probe, reader, runner))
        probe.hidden[index] = reader
    if probe.hidden and max(probe.hidden) >= probe.last_layer:
        probe.last_layer, probe.finish_on_hidden = max(probe.hidden), True
