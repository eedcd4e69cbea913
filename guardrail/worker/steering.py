"""Activation steering and residual capture inside vLLM's worker (eager mode only).

Forward hooks on the decoder layers add a steering delta to the residual stream of the
requests that ask for it (``extra_args[STEER_ARG]``), at every position they compute (prefill
chunks and decode steps). A layer returns (hidden_states, residual) and the stream is their
sum: the delta is computed from ``h + r`` and added to ``h`` alone, and only on steered rows
(out-of-place ``index_add``), so every other row of the batch stays bit-identical. Nothing
is kept per request between steps: each step reads the specs from the requests themselves.
The same hooks can capture the stream of a request's last prompt token (``CAPTURE_ARG``) for
building vectors. Python forward hooks only run in eager mode, so loading refuses otherwise.

Batched per step, as the probe is: the first hook of a step reads the batch layout from the
model runner's host buffers (no synchronisation with the device), groups the steered requests
by what steers them (vector, method, coefficient; normally one group) and sends each group's
token rows to the device in one non-blocking copy; each hooked layer then steers a group with a
gather, one delta and, for the step, one ``index_add``, whatever the number of requests.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from guardrail.protocol import (
    CAPTURE_ARG,
    MAX_STORED_RESULTS,
    STEER_ARG,
    SteerReportData,
    SteerSpec,
)
from guardrail.steering.math import SteeringMethod, steering_delta
from guardrail.worker.forward import decoder_layers, step_metadata
from guardrail.worker.rows import HostStaging, batch_layout

__all__ = ["SteeringHooks"]


@dataclass
class _Vector:
    layer: int
    direction: torch.Tensor  # [hidden] float32, on the model's device
    avg_proj: float


@dataclass
class _SteerRow:
    """One steered or captured request in the current step."""

    key: str
    start: int  # its token rows in the step's flattened batch: [start, end)
    end: int
    capture_row: int | None  # row of its last prompt token, when computed in this step
    vector: _Vector | None = None  # None: not steered (or its spec was rejected)
    method: SteeringMethod = "add_vector"
    coefficient: float = 0.0


@dataclass
class _SteerGroup:
    """The step's requests steered alike (one vector, method and coefficient): their token
    rows of the flattened batch, on the device, and the rows on the host (reports)."""

    vector: _Vector
    method: SteeringMethod
    coefficient: float
    rows: list[_SteerRow] = field(default_factory=list)
    index: torch.Tensor | None = None  # [tokens] long: every member's token rows


class _Steering:
    """Steering state of one worker: loaded vectors, hooks, this step's rows, reports."""

    def __init__(self, device: Any = "cpu") -> None:
        self.staging = HostStaging(device)  # the step's token rows to the device
        self.vectors: dict[str, _Vector] = {}
        self.capture_layers: set[int] = set()
        self.handles: dict[int, Any] = {}  # layer -> RemovableHandle of its forward hook
        self.reports: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._step: object = None
        self._rows: list[_SteerRow] = []
        self._groups: list[_SteerGroup] = []
        self._captures: torch.Tensor | None = None  # [captured rows] their last prompt token

    def report(self, key: str) -> dict[str, Any]:
        if key not in self.reports:
            self.reports[key] = {"tokens": 0, "error": None, "residuals": {}}
            while len(self.reports) > MAX_STORED_RESULTS:
                self.reports.popitem(last=False)
        return self.reports[key]

    def plan(self, runner: Any) -> list[_SteerRow]:
        """This step's steered/captured requests (computed once per step, by the first hook)."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if context is self._step:
            return self._rows
        self._step, self._rows, self._groups, self._captures = context, [], [], None
        metadata = step_metadata(context)
        if metadata is None:  # warm-up, profiling, micro-batching
            return self._rows
        found: list[tuple[int, Any, Any, Any]] = []
        for i, rid in enumerate(runner.input_batch.req_ids):
            state = runner.requests.get(rid)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            if STEER_ARG in extra or CAPTURE_ARG in extra:
                found.append((i, state, extra.get(STEER_ARG), extra.get(CAPTURE_ARG)))
        if not found:
            return self._rows
        starts, computed = batch_layout(runner, metadata)  # host buffers: no device sync
        for i, state, steer, capture in found:
            start, end = int(starts[i]), int(starts[i + 1])
            capture_row = None
            first_pos, last_prompt = int(computed[i]), state.num_prompt_tokens - 1
            if capture and first_pos <= last_prompt < first_pos + (end - start):
                capture_row = start + last_prompt - first_pos
            row = _SteerRow(str((steer or capture)["key"]), start, end, capture_row)
            if steer:
                self._resolve(row, steer)
            self._rows.append(row)
        self._batch()
        return self._rows

    def _batch(self) -> None:
        """Group the step's steered rows and send every index the layers need to the device,
        in one copy."""
        groups: dict[tuple[int, str, float], _SteerGroup] = {}
        for row in self._rows:
            if row.vector is not None:
                how = (id(row.vector), row.method, row.coefficient)
                if how not in groups:
                    groups[how] = _SteerGroup(row.vector, row.method, row.coefficient)
                groups[how].rows.append(row)
        self._groups = list(groups.values())
        parts = [
            np.arange(row.start, row.end, dtype=np.int64)
            for group in self._groups
            for row in group.rows
        ]
        captured = [row.capture_row for row in self._rows if row.capture_row is not None]
        packed = np.concatenate([*parts, np.asarray(captured, dtype=np.int64)])
        if not packed.size:  # rows whose steering was refused, nothing captured
            return
        on_device = self.staging.to_device(packed)
        at = 0
        for group in self._groups:
            size = sum(row.end - row.start for row in group.rows)
            group.index, at = on_device[at : at + size], at + size
        if captured:
            self._captures = on_device[at:]

    def _resolve(self, row: _SteerRow, steer: SteerSpec) -> None:
        """Attach the request's vector; a bad spec is recorded for that request alone."""
        vector = self.vectors.get(str(steer.get("vector")))
        method, coefficient = steer.get("method"), steer.get("coefficient")
        if vector is None:
            error = f"steering vector {steer.get('vector')!r} is not loaded in the worker"
        elif method not in ("add_vector", "adjust_rs"):
            error = f"unknown steering method {method!r}"
        elif not isinstance(coefficient, int | float) or not math.isfinite(coefficient):
            error = f"steering coefficient must be a finite number, got {coefficient!r}"
        else:
            row.vector, row.method, row.coefficient = vector, method, float(coefficient)  # type: ignore[assignment]
            return
        report = self.report(row.key)
        report["error"] = report["error"] or error

    def on_layer(self, layer: int, output: Any) -> Any:
        """The hook body: capture, then steer; returns the replaced pair or None (unchanged)."""
        hidden, residual = output
        if layer in self.capture_layers and self._captures is not None:
            streams = hidden.index_select(0, self._captures)
            if residual is not None:
                streams = streams + residual.index_select(0, self._captures)
            # calibration only (building vectors): one copy to the host for the step's rows
            captured = [row for row in self._rows if row.capture_row is not None]
            for row, stream in zip(captured, streams.float().cpu(), strict=True):
                self.report(row.key)["residuals"][layer] = stream
        steered = [group for group in self._groups if group.vector.layer == layer]
        if not steered:
            return None
        deltas, index = [], []
        for group in steered:
            assert group.index is not None
            stream = hidden.index_select(0, group.index)
            if residual is not None:
                stream = stream + residual.index_select(0, group.index)
            deltas.append(
                steering_delta(
                    stream, group.vector.direction, group.method, group.coefficient,
                    group.vector.avg_proj,
                )
            )  # fmt: skip
            index.append(group.index)
            for row in group.rows:
                self.report(row.key)["tokens"] += row.end - row.start
        if len(steered) > 1:
            hidden = hidden.index_add(0, torch.cat(index), torch.cat(deltas).to(hidden.dtype))
        else:
            hidden = hidden.index_add(0, index[0], deltas[0].to(hidden.dtype))
        return hidden, residual

    def fail_step(self, layer: int, exc: Exception) -> None:
        for row in self._rows:
            report = self.report(row.key)
            report["error"] = report["error"] or f"layer {layer}: {type(exc).__name__}: {exc}"


def _make_steering_hook(steering: _Steering, layer: int, runner: Any) -> Any:
    """The forward hook of one decoder layer; never raises into the engine."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        try:
            if not steering.plan(runner):
                return None
            return steering.on_layer(layer, output)
        except Exception as exc:  # recorded for the step's requests; the caller fails them
            steering.fail_step(layer, exc)
            return None

    return hook


class SteeringHooks:
    """The worker's steering component: loaded vectors, capture layers and their hooks.

    ``GuardrailWorkerExtension`` holds one and forwards the steering RPCs to it.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.state = _Steering(runner.device)

    def _decoder_layers(self) -> Any:
        layers = decoder_layers(self.runner)
        if layers is None:
            raise RuntimeError(f"{type(self.runner.model).__name__} has no model.layers to steer")
        return layers

    def _require_eager(self) -> None:
        if not self.runner.vllm_config.model_config.enforce_eager:
            raise RuntimeError(
                "steering needs an engine started with enforce_eager=True: in compiled mode "
                "the decoder layers run inside a captured graph where steering hooks never fire"
            )

    def _sync_hooks(self) -> list[int]:
        """Hook exactly the layers that hold a vector or are captured; one handle each."""
        state = self.state
        wanted = {v.layer for v in state.vectors.values()} | state.capture_layers
        layers = self._decoder_layers()
        for layer in sorted(set(state.handles) - wanted):
            state.handles.pop(layer).remove()
        for layer in sorted(wanted - set(state.handles)):
            hook = _make_steering_hook(state, layer, self.runner)
            state.handles[layer] = layers[layer].register_forward_hook(hook)
        return sorted(state.handles)

    def load(self, name: str, direction: list[float], layer: int, avg_proj: float) -> list[int]:
        """Keep a vector on the device under ``name`` (replacing one of that name) and hook its
        layer. Returns the hooked layers."""
        self._require_eager()
        num_layers = len(self._decoder_layers())
        if not 0 <= layer < num_layers:
            raise ValueError(f"steering layer {layer} outside the model's {num_layers} layers")
        vector = torch.tensor(direction, dtype=torch.float32, device=self.runner.device)
        self.state.vectors[name] = _Vector(int(layer), vector, float(avg_proj))
        return self._sync_hooks()

    def unload(self, names: list[str] | None = None) -> list[int]:
        """Forget vectors (all when ``names`` is None) and remove hooks no longer needed."""
        for name in list(self.state.vectors) if names is None else names:
            self.state.vectors.pop(name, None)
        return self._sync_hooks()

    def capture(self, layers: list[int]) -> list[int]:
        """Capture the stream at these layers for requests carrying ``CAPTURE_ARG``
        (an empty list stops capturing). Returns the hooked layers."""
        self._require_eager()
        num_layers = len(self._decoder_layers())
        bad = [layer for layer in layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(f"capture layers {bad} outside the model's {num_layers} layers")
        self.state.capture_layers = {int(layer) for layer in layers}
        return self._sync_hooks()

    def pop(self, keys: list[str]) -> dict[str, SteerReportData]:
        """Remove and return the reports of ``keys``: tokens steered, error, and captured
        streams as ``[[layer, values], ...]`` (plain data: RPC results cross processes)."""
        out: dict[str, SteerReportData] = {}
        for key in keys:
            report = self.state.reports.pop(key, None)
            if report is not None:
                residuals = report["residuals"]
                pairs = [[layer, stream.tolist()] for layer, stream in sorted(residuals.items())]
                out[key] = {
                    "tokens": report["tokens"],
                    "error": report["error"],
                    "residuals": pairs,
                }
        return out
