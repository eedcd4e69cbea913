"""The worker extension: the one module that touches vLLM internals.

vLLM instantiates ``GuardrailWorkerExtension`` as a mixin of its worker (``worker_extension_cls``),
in the worker process, and the caller drives it with ``collective_rpc``. The probe wraps each
hooked layer's attention *implementation* (``Attention.impl.forward``), which vLLM calls as plain
Python even in its compiled mode (attention is the splitting op between compiled pieces), after
the layer's new keys were written to the paged KV cache. There it has everything it needs:

- the post-RoPE queries of the step's tokens ``[tokens, heads, dim]``,
- the paged KV cache and each request's block table, so keys of prefix-cached blocks and of
  earlier chunked-prefill steps are read back (``guardrail.kv_layout``),
- ``query_start_loc`` / ``seq_lens`` to map the flattened batch back to requests.

A request opts in through ``SamplingParams.extra_args[PROBE_ARG]`` (its key and token spans), so
scores are matched to requests by data the request carries, never by vLLM's internal ids. A
request is scored once, in the step that computes its last prompt token. Results wait in a
bounded store until the caller pops them by key. Nothing here raises into the engine: a failure
is recorded for the request it concerns.

The second section, activation steering, hooks decoder layers (eager mode only) to add a
steering vector to the residual stream of the requests that carry ``STEER_ARG``, and to capture
that stream for building vectors (see the section's header comment).
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from guardrail.kv_layout import KeyGather, key_gather_for
from guardrail.scoring import head_attention_stats, spans_to_mask
from guardrail.steering import SteeringMethod, steering_delta

PROBE_ARG = "guardrail_probe"
"""Key in ``SamplingParams.extra_args`` that carries a request's probe spec."""

MAX_STORED_RESULTS = 65536

# The probe of each engine in this process, by id() of the engine's VllmConfig: the logits
# processor below is built by vLLM before the probe is installed, and finds it here.
_PROBES: dict[int, _Probe] = {}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _no_gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    raise RuntimeError("probe has no hooked layer")


@dataclass
class _Row:
    """One request being scored in the current step."""

    key: str
    token_row: int  # row of the last prompt token in the step's flattened batch
    num_prompt_tokens: int
    block_ids: torch.Tensor
    instruction_mask: torch.Tensor
    data_mask: torch.Tensor
    scores: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None
    stop_below: float | None = None
    stop_on_error: bool = True


@dataclass
class _Layer:
    index: int
    local_heads: torch.Tensor  # query heads of this rank to score, local indices
    global_heads: list[int]
    impl: Any
    original_forward: Any
    had_instance_forward: bool


class _Probe:
    """Probe state of one worker: hooked layers, the current step's plan, finished results."""

    def __init__(self, heads: list[tuple[int, int]], fault_keys: set[str]) -> None:
        self.heads = heads
        self.layers: dict[int, _Layer] = {}
        self.last_layer = -1
        self.gather: KeyGather = _no_gather
        self.results: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # internal request id -> probe key while the request still waits for its score, else None
        self.pending: dict[str, str | None] = {}
        self.fault_keys = fault_keys
        self.stop_keys: set[str] = set()  # keys whose next sampled token must be the stop token
        self._step: object = None
        self._rows: list[_Row] = []
        self._probe_seconds = 0.0

    # -- step planning -------------------------------------------------------------------------
    def _probe_key(self, runner: Any, req_id: str) -> str | None:
        if req_id not in self.pending:
            state = runner.requests.get(req_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            spec = extra.get(PROBE_ARG)
            self.pending[req_id] = spec["key"] if spec else None
            if len(self.pending) > 4 * max(len(runner.requests), 256):
                self.pending = {r: k for r, k in self.pending.items() if r in runner.requests}
        return self.pending[req_id]

    def plan(self, runner: Any, step: object, metadata: Any) -> list[_Row]:
        """Rows to score in this step: guarded requests whose last prompt token is computed now.

        ``step`` is the step's forward context: one object per model step, shared by all layers.
        """
        if step is self._step:
            return self._rows
        self._step, self._rows = step, []
        self._probe_seconds = 0.0
        batch_ids = runner.input_batch.req_ids
        pending = [(i, rid) for i, rid in enumerate(batch_ids) if self._probe_key(runner, rid)]
        if not pending:
            return self._rows
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        for i, rid in pending:
            state = runner.requests[rid]
            num_prompt = state.num_prompt_tokens
            first_pos = seq_lens[i] - (starts[i + 1] - starts[i])
            if not first_pos <= num_prompt - 1 < seq_lens[i]:
                continue  # last prompt token not in this step (earlier chunk, or decode)
            self.pending[rid] = None  # scored once, even if preempted and recomputed later
            self._rows.append(
                self._make_row(state, i, starts[i] + num_prompt - 1 - first_pos, metadata)
            )
        return self._rows

    def _make_row(self, state: Any, batch_index: int, token_row: int, metadata: Any) -> _Row:
        spec = state.sampling_params.extra_args[PROBE_ARG]
        n = state.num_prompt_tokens
        device = metadata.block_table.device
        row = _Row(
            spec["key"],
            token_row,
            n,
            torch.empty(0),
            torch.empty(0),
            torch.empty(0),
            stop_below=spec.get("stop_below"),
            stop_on_error=spec.get("stop_on_error", True),
        )
        try:
            block_size = self.block_size
            row.block_ids = metadata.block_table[batch_index, : (n + block_size - 1) // block_size]
            row.instruction_mask = spans_to_mask([tuple(s) for s in spec["instruction"]], n, device)
            row.data_mask = spans_to_mask([tuple(s) for s in spec["data"]], n, device)
            if spec.get("num_prompt_tokens", n) != n:
                raise ValueError(
                    f"engine saw {n} prompt tokens, request spans were made for "
                    f"{spec['num_prompt_tokens']}"
                )
        except Exception as exc:  # recorded for this request, never raised into the engine
            row.error = f"plan: {type(exc).__name__}: {exc}"
        return row

    # -- per layer -----------------------------------------------------------------------------
    def score_layer(
        self, layer: _Layer, query: torch.Tensor, kv_cache: torch.Tensor, key: torch.Tensor
    ) -> None:
        for row in self._rows:
            if row.error is not None:
                continue
            try:
                if row.key in self.fault_keys:
                    raise RuntimeError("fault injected for testing")
                keys = self.gather(kv_cache, row.block_ids, row.num_prompt_tokens)
                if not torch.allclose(keys[-1], key[row.token_row], rtol=1e-3, atol=1e-3):
                    raise RuntimeError(
                        "KV cache layout check failed: cached key of the last "
                        "prompt token differs from the key the layer computed"
                    )
                q = query[row.token_row].index_select(0, layer.local_heads)
                row.scores.append(
                    head_attention_stats(
                        q,
                        keys,
                        self.kv_index(layer, kv_cache.shape[1]),
                        row.instruction_mask,
                        row.data_mask,
                        float(layer.impl.scale),
                        layer.impl.logits_soft_cap,
                    )
                )
            except Exception as exc:
                row.error = f"layer {layer.index}: {type(exc).__name__}: {exc}"

    def kv_index(self, layer: _Layer, local_kv_heads: int) -> torch.Tensor:
        group = self.local_num_heads // local_kv_heads
        return torch.div(layer.local_heads, group, rounding_mode="floor")

    def finish_step(self) -> None:
        """After the last hooked layer: one transfer for all rows, results stored by key."""
        rows, self._rows = self._rows, []
        ok = [r for r in rows if r.error is None]
        values = torch.cat([torch.cat(r.scores) for r in ok]).tolist() if ok else []
        heads = [(lay.index, h) for lay in self.layers.values() for h in lay.global_heads]
        latency = self._probe_seconds
        offset = 0
        for row in rows:
            result: dict[str, Any] = {
                "num_prompt_tokens": row.num_prompt_tokens,
                "probe_seconds": latency / max(len(rows), 1),
            }
            if row.error is None:
                chunk = values[offset : offset + len(heads)]
                offset += len(heads)
                result["heads"] = [[lay, h, s] for (lay, h), s in zip(heads, chunk, strict=True)]
            else:
                result["error"] = row.error
            self._decide_stop(
                row, result, dict(zip(heads, chunk, strict=True)) if row.error is None else None
            )
            self.results[row.key] = result
        while len(self.results) > MAX_STORED_RESULTS:
            self.results.popitem(last=False)

    def _decide_stop(
        self, row: _Row, result: dict[str, Any], scores: dict[Any, float] | None
    ) -> None:
        """Early stop: a request whose focus is at or below its ``stop_below`` ends right after
        prefill (its first sampled token is forced to its stop token)."""
        if row.stop_below is None:
            return
        if scores is None or self.config is None:
            stop = row.stop_on_error
        else:
            try:
                focus = self.config.focus(scores)
                result["focus"] = focus
                stop = focus <= row.stop_below
            except Exception as exc:
                result["error"] = f"aggregate: {type(exc).__name__}: {exc}"
                stop = row.stop_on_error
        if stop:
            self.stop_keys.add(row.key)
            result["stopped"] = True

    block_size: int = 0
    local_num_heads: int = 0
    config: Any = None  # ModelProbeConfig when this rank holds every head (stop decisions)


def _make_probe_forward(probe: _Probe, layer: _Layer, runner: Any) -> Any:
    """The wrapper that replaces ``impl.forward`` of one hooked layer."""
    from vllm.forward_context import get_forward_context

    original = layer.original_forward

    def forward(
        attn_layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        out = original(attn_layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if attn_metadata is None:  # warm-up and profiling runs
            return out
        started = time.perf_counter()
        try:
            if probe.plan(runner, get_forward_context(), attn_metadata):
                probe.score_layer(layer, query, kv_cache, key)
                if layer.index == probe.last_layer:
                    probe._probe_seconds += time.perf_counter() - started
                    probe.finish_step()
                    return out
        except Exception as exc:  # a bug here must not take the engine down
            for row in probe._rows:
                row.error = row.error or f"probe: {type(exc).__name__}: {exc}"
        probe._probe_seconds += time.perf_counter() - started
        return out

    return forward


# == Activation steering ========================================================================
# Forward hooks on the decoder layers add a steering delta to the residual stream of the
# requests that ask for it (``extra_args[STEER_ARG]``), at every position they compute (prefill
# chunks and decode steps). A layer returns (hidden_states, residual) and the stream is their
# sum: the delta is computed from ``h + r`` and added to ``h`` alone, and only on steered rows
# (out-of-place ``index_add``), so every other row of the batch stays bit-identical. Nothing
# is kept per request between steps: each step reads the specs from the requests themselves.
# The same hooks can capture the stream of a request's last prompt token (``CAPTURE_ARG``) for
# building vectors. Python forward hooks only run in eager mode, so loading refuses otherwise.

STEER_ARG = "guardrail_steer"
"""``extra_args`` key of a steered request: {"key", "vector", "method", "coefficient"}."""
CAPTURE_ARG = "guardrail_capture"
"""``extra_args`` key of a request whose last-prompt-token stream is captured: {"key"}."""


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


class _Steering:
    """Steering state of one worker: loaded vectors, hooks, this step's rows, reports."""

    def __init__(self) -> None:
        self.vectors: dict[str, _Vector] = {}
        self.capture_layers: set[int] = set()
        self.handles: dict[int, Any] = {}  # layer -> RemovableHandle of its forward hook
        self.reports: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._step: object = None
        self._rows: list[_SteerRow] = []

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
        self._step, self._rows = context, []
        metadata: Any = context.attn_metadata
        if isinstance(metadata, dict):
            metadata = next(iter(metadata.values()), None)
        if metadata is None or isinstance(metadata, list):  # warm-up, profiling, micro-batching
            return self._rows
        found: list[tuple[int, Any, Any, Any]] = []
        for i, rid in enumerate(runner.input_batch.req_ids):
            state = runner.requests.get(rid)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            if STEER_ARG in extra or CAPTURE_ARG in extra:
                found.append((i, state, extra.get(STEER_ARG), extra.get(CAPTURE_ARG)))
        if not found:
            return self._rows
        starts, seq_lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
        for i, state, steer, capture in found:
            start, end = starts[i], starts[i + 1]
            capture_row = None
            first_pos, last_prompt = seq_lens[i] - (end - start), state.num_prompt_tokens - 1
            if capture and first_pos <= last_prompt < seq_lens[i]:
                capture_row = start + last_prompt - first_pos
            row = _SteerRow(str((steer or capture)["key"]), start, end, capture_row)
            if steer:
                self._resolve(row, steer)
            self._rows.append(row)
        return self._rows

    def _resolve(self, row: _SteerRow, steer: dict[str, Any]) -> None:
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
            row.vector, row.method, row.coefficient = vector, method, float(coefficient)
            return
        report = self.report(row.key)
        report["error"] = report["error"] or error

    def on_layer(self, layer: int, output: Any) -> Any:
        """The hook body: capture, then steer; returns the replaced pair or None (unchanged)."""
        hidden, residual = output
        rows = self._rows
        if layer in self.capture_layers:
            for row in rows:
                if row.capture_row is not None:
                    stream = hidden[row.capture_row] + (
                        0 if residual is None else residual[row.capture_row]
                    )
                    self.report(row.key)["residuals"][layer] = stream.float().cpu()
        steered = [
            (row, row.vector)
            for row in rows
            if row.vector is not None and row.vector.layer == layer
        ]
        if not steered:
            return None
        deltas, index = [], []
        for row, vec in steered:
            rows_index = torch.arange(row.start, row.end, device=hidden.device)
            stream = hidden.index_select(0, rows_index)
            if residual is not None:
                stream = stream + residual.index_select(0, rows_index)
            delta = steering_delta(stream, vec.direction, row.method, row.coefficient, vec.avg_proj)
            deltas.append(delta)
            index.append(rows_index)
            self.report(row.key)["tokens"] += row.end - row.start
        hidden = hidden.index_add(0, torch.cat(index), torch.cat(deltas).to(hidden.dtype))
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


class SteeringWorkerMixin:
    """The steering RPCs of ``GuardrailWorkerExtension`` (called through ``collective_rpc``)."""

    _guardrail_steering: _Steering | None = None

    def _steering_state(self) -> _Steering:
        if self._guardrail_steering is None:
            self._guardrail_steering = _Steering()
        return self._guardrail_steering

    def _decoder_layers(self) -> Any:
        model = self.model_runner.model  # type: ignore[attr-defined]
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise RuntimeError(f"{type(model).__name__} has no model.layers to steer")
        return layers

    def _require_eager(self) -> None:
        config = self.model_runner.vllm_config  # type: ignore[attr-defined]
        if not config.model_config.enforce_eager:
            raise RuntimeError(
                "steering needs an engine started with enforce_eager=True: in compiled mode "
                "the decoder layers run inside a captured graph where steering hooks never fire"
            )

    def _sync_hooks(self) -> list[int]:
        """Hook exactly the layers that hold a vector or are captured; one handle each."""
        state = self._steering_state()
        wanted = {v.layer for v in state.vectors.values()} | state.capture_layers
        layers = self._decoder_layers()
        for layer in sorted(set(state.handles) - wanted):
            state.handles.pop(layer).remove()
        for layer in sorted(wanted - set(state.handles)):
            runner = self.model_runner  # type: ignore[attr-defined]
            hook = _make_steering_hook(state, layer, runner)
            state.handles[layer] = layers[layer].register_forward_hook(hook)
        return sorted(state.handles)

    def guardrail_load_steering(
        self, name: str, direction: list[float], layer: int, avg_proj: float
    ) -> list[int]:
        """Keep a vector on the device under ``name`` (replacing one of that name) and hook its
        layer. Returns the hooked layers."""
        self._require_eager()
        num_layers = len(self._decoder_layers())
        if not 0 <= layer < num_layers:
            raise ValueError(f"steering layer {layer} outside the model's {num_layers} layers")
        device = self.model_runner.device  # type: ignore[attr-defined]
        vector = torch.tensor(direction, dtype=torch.float32, device=device)
        self._steering_state().vectors[name] = _Vector(int(layer), vector, float(avg_proj))
        return self._sync_hooks()

    def guardrail_unload_steering(self, names: list[str] | None = None) -> list[int]:
        """Forget vectors (all when ``names`` is None) and remove hooks no longer needed."""
        state = self._steering_state()
        for name in list(state.vectors) if names is None else names:
            state.vectors.pop(name, None)
        return self._sync_hooks()

    def guardrail_capture_layers(self, layers: list[int]) -> list[int]:
        """Capture the stream at these layers for requests carrying ``CAPTURE_ARG``
        (an empty list stops capturing). Returns the hooked layers."""
        self._require_eager()
        num_layers = len(self._decoder_layers())
        bad = [layer for layer in layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(f"capture layers {bad} outside the model's {num_layers} layers")
        self._steering_state().capture_layers = {int(layer) for layer in layers}
        return self._sync_hooks()

    def guardrail_pop_steering(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """Remove and return the reports of ``keys``: tokens steered, error, and captured
        streams as ``[[layer, values], ...]`` (plain data: RPC results cross processes)."""
        state = self._steering_state()
        out = {}
        for key in keys:
            report = state.reports.pop(key, None)
            if report is not None:
                residuals = report["residuals"]
                pairs = [[layer, stream.tolist()] for layer, stream in sorted(residuals.items())]
                out[key] = {**report, "residuals": pairs}
        return out


# == The worker extension ======================================================================


class GuardrailWorkerExtension(SteeringWorkerMixin):
    """Mixed into vLLM's worker class; every public method is called through ``collective_rpc``."""

    _guardrail_probe: _Probe | None = None
    _guardrail_faults: set[str]

    def guardrail_model_info(self) -> dict[str, Any]:
        """Sizes, backend and compilation facts the caller validates configs against."""
        runner = self.model_runner  # type: ignore[attr-defined]
        from vllm.distributed import parallel_state

        vcfg = runner.vllm_config
        text_cfg = vcfg.model_config.hf_text_config
        layers = self._attention_layers()
        impl = next(iter(layers.values())).impl
        cudagraph_mode = getattr(vcfg.compilation_config, "cudagraph_mode", None)
        return {
            "num_layers": int(text_cfg.num_hidden_layers),
            "num_heads": int(text_cfg.num_attention_heads),
            "num_kv_heads": int(
                getattr(text_cfg, "num_key_value_heads", text_cfg.num_attention_heads)
            ),
            "hidden_size": int(text_cfg.hidden_size),
            "attention_layers": len(layers),
            "backend": type(impl).__name__,
            "isa": getattr(next(iter(layers.values())), "isa", None),
            "kv_cache_dtype": str(vcfg.cache_config.cache_dtype),
            "block_size": int(vcfg.cache_config.block_size),
            "enforce_eager": bool(vcfg.model_config.enforce_eager),
            "compilation_mode": str(getattr(vcfg.compilation_config, "mode", None)),
            "cudagraph_mode": str(cudagraph_mode),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "device": str(runner.device),
        }

    def _attention_layers(self) -> dict[int, Any]:
        context = self.model_runner.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
        layers = {}
        for name, module in context.items():
            match = _LAYER_INDEX.search(name)
            if match and hasattr(module, "impl"):
                layers[int(match.group(1))] = module
        return layers

    def guardrail_install(self, heads: list[list[int]], config: dict[str, Any]) -> dict[str, Any]:
        """Install the probe on the layers holding ``heads`` ([layer, head], global indices).

        ``config`` is the model's ``ModelProbeConfig`` as plain data: with every head on this
        rank, the worker combines head scores into the focus itself (for early stops).
        """
        self.guardrail_uninstall()
        info = self.guardrail_model_info()
        if info["kv_cache_dtype"] not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"quantized KV cache ({info['kv_cache_dtype']}) is not supported by "
                "the probe: keys read back would be quantized; use kv_cache_dtype='auto'"
            )
        layers = self._attention_layers()
        per_rank = info["num_heads"] // info["tp_size"]
        lo = info["tp_rank"] * per_rank
        self._guardrail_faults = getattr(self, "_guardrail_faults", set())
        probe = _Probe([(int(a), int(b)) for a, b in heads], self._guardrail_faults)
        probe.block_size, probe.local_num_heads = info["block_size"], per_rank
        by_layer: dict[int, list[int]] = {}
        for layer_index, head in probe.heads:
            if lo <= head < lo + per_rank:
                by_layer.setdefault(layer_index, []).append(head)
        for layer_index, global_heads in sorted(by_layer.items()):
            module = layers[layer_index]
            probe.gather = key_gather_for(type(module.impl).__name__, getattr(module, "isa", None))
            layer = _Layer(
                layer_index,
                torch.tensor([h - lo for h in global_heads], device=self.model_runner.device),  # type: ignore[attr-defined]
                global_heads,
                module.impl,
                module.impl.forward,
                "forward" in vars(module.impl),
            )
            module.impl.forward = _make_probe_forward(probe, layer, self.model_runner)  # type: ignore[attr-defined]
            probe.layers[layer_index] = layer
        probe.last_layer = max(probe.layers, default=-1)
        if info["tp_size"] == 1:
            from guardrail.config import ModelProbeConfig

            probe.config = ModelProbeConfig.model_validate(config)
        self._guardrail_probe = probe
        _PROBES[id(self.model_runner.vllm_config)] = probe  # type: ignore[attr-defined]
        return {**info, "hooked_layers": sorted(probe.layers)}

    def guardrail_uninstall(self) -> None:
        """Remove the probe; the engine runs exactly as before it was installed."""
        probe = self._guardrail_probe
        if probe is not None:
            for layer in probe.layers.values():
                if layer.had_instance_forward:
                    layer.impl.forward = layer.original_forward
                else:
                    del layer.impl.forward  # back to the class's method
        self._guardrail_probe = None
        _PROBES.pop(id(self.model_runner.vllm_config), None)  # type: ignore[attr-defined]

    def guardrail_pop_results(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """Remove and return the stored results of ``keys`` (missing keys are absent)."""
        probe = self._guardrail_probe
        if probe is None:
            return {}
        return {k: probe.results.pop(k) for k in keys if k in probe.results}

    def guardrail_set_faults(self, keys: list[str]) -> None:
        """Testing hook: requests with these probe keys fail inside the probe."""
        self._guardrail_faults = getattr(self, "_guardrail_faults", set())
        self._guardrail_faults.clear()
        self._guardrail_faults.update(keys)


class ProbeStopLogitsProcessor(LogitsProcessor):
    """vLLM logits processor that ends probe-stopped requests right after their prefill.

    In the step where the probe decides to stop a request, this forces the request's first
    sampled token to its stop token, so the scheduler finishes it: one token, no decode steps.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._config_id = id(vllm_config)
        self._rows: dict[int, tuple[str, int]] = {}  # batch index -> (probe key, stop token)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            spec = (params.extra_args or {}).get(PROBE_ARG) if params is not None else None
            if spec and spec.get("stop_token") is not None:
                self._rows[index] = (spec["key"], int(spec["stop_token"]))
            else:
                self._rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            moving = self._rows.pop(a, None)
            other = self._rows.pop(b, None)
            if direction.name == "SWAP" and other is not None:
                self._rows[a] = other
            if moving is not None:
                self._rows[b] = moving

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        probe = _PROBES.get(self._config_id)
        if probe is None or not probe.stop_keys:
            return logits
        for index, (key, stop_token) in self._rows.items():
            if key in probe.stop_keys and index < logits.shape[0]:
                probe.stop_keys.discard(key)
                logits[index] = float("-inf")
                logits[index, stop_token] = 0.0
        return logits
