"""The attention probe inside vLLM's worker: plan each step, score the hooked layers, store.

The probe wraps each hooked layer's attention *implementation* (``Attention.impl.forward``),
which vLLM calls as plain Python even in its compiled mode (attention is the splitting op between
compiled pieces), after the layer's new keys were written to the paged KV cache. There it has:

- the post-RoPE queries of the step's tokens ``[tokens, heads, dim]``,
- the paged KV cache and each request's block table, so keys of prefix-cached blocks and of
  earlier chunked-prefill steps are read back (``guardrail.probe.kv_layout``),
- ``query_start_loc`` / ``seq_lens`` to map the flattened batch back to requests.

A request opts in through ``SamplingParams.extra_args[PROBE_ARG]`` (its key and token spans), so
scores are matched to requests by data the request carries, never by vLLM's internal ids. A
request is scored once, in the step that computes its last prompt token. Results wait in a
bounded store until the caller pops them by key. Nothing here raises into the engine: a failure
is recorded for the request it concerns.

The hidden-state signal is read in the same pass, by decoder-layer hooks that share this
probe's step plan and rows (``guardrail.worker.hidden``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.device_focus import DeviceFocus
from guardrail.probe.fused_stats import fused_available
from guardrail.probe.kv_layout import KeyGather, key_gather_for, key_view_for
from guardrail.probe.scoring import ATTENTION_STATS, HeadKey, batched_logits, stats_from_logits
from guardrail.protocol import (
    PROBE_ARG,
    ProbeErrorReason,
    ProbeResultData,
    injected_fault_message,
)
from guardrail.worker.fused import FusedLayers
from guardrail.worker.hidden import HiddenReader, install_hidden
from guardrail.worker.layer import Layer
from guardrail.worker.results import FinishedStep, ResultStore
from guardrail.worker.rows import (
    LAYOUT,
    NONFINITE,
    OTHER_RANK,
    HostStaging,
    StepRows,
    batch_layout,
    check_slots,
    host_block_table,
    plan_rows,
)

__all__ = [
    "PROBES",
    "Layer",
    "Probe",
    "install_probe",
    "make_probe_forward",
    "uninstall_probe",
]

PROBES: dict[int, Probe] = {}
"""The probe of each engine in this process, by id() of the engine's VllmConfig: the stop
logits processor (``guardrail.worker.stop``) is built by vLLM before the probe is installed,
and finds it here."""

WIDTH = len(ATTENTION_STATS)
CHUNK_ELEMENTS = 1 << 26
"""Rows are scored in chunks whose float32 key copy stays under this many elements (256 MiB)."""


def _no_gather(
    kv_cache: torch.Tensor, slots: torch.Tensor, kv_heads: torch.Tensor | None = None
) -> torch.Tensor:
    raise RuntimeError("probe has no hooked layer")


@dataclass
class Stops:
    """The step's early-stop decision, on the device, for the stop logits processor."""

    batch_index: list[int]  # host: the rows' indices in the batch (= logits rows)
    index: torch.Tensor  # [R] the same, on the device
    tokens: torch.Tensor  # [R] each row's stop token
    stop: torch.Tensor  # [R] bool: force the stop token


@dataclass(frozen=True)
class ProbeSettings:
    """What the probe needs to know about the engine, fixed at install."""

    block_size: int
    tp_size: int = 1
    pp_size: int = 1
    device: Any = "cpu"
    fused: bool = False  # Triton kernels (``guardrail.probe.fused_stats``): one launch per step


class Probe:
    """Probe state of one worker: hooked layers, the current step's rows, finished results.

    Per step: ``plan`` (first hooked layer: host facts, device tensors), ``score_layer`` per
    hooked attention layer, ``HiddenReader.read`` per read decoder layer, ``finish_step`` after
    the last (the stats, focus and stops on the device, one non-blocking copy, into ``store``).
    ``pop`` hands results to the caller, waiting for those copies (``guardrail.worker.results``).

    What ``score_layer`` does depends on the path. PyTorch: a few kernels for the layer's
    logits, whose stats ``finish_step`` computes for all layers at once. Fused kernels
    (``fused``, ``guardrail.worker.fused``): each layer's own kernel in the first step that
    scores rows, then one launch per step for the layers grouped after it.
    """

    def __init__(
        self,
        heads: list[tuple[int, int]],
        fault_keys: set[str],
        settings: ProbeSettings,
        config: ModelProbeConfig | None,
    ) -> None:
        self.heads = heads
        self.settings = settings
        self.config = config  # combines head scores into the focus (stops)
        self.layers: dict[int, Layer] = {}
        self.hidden: dict[int, HiddenReader] = {}
        self.first_layer = -1  # the first hooked attention layer (checks the KV layout)
        self.last_layer = -1  # the step's probe finishes after this layer's attention ...
        self.finish_on_hidden = False  # ... or after this decoder layer's output
        self.needs_data_slots = False  # a hidden reader averages over the data tokens
        self.gather: KeyGather = _no_gather
        self.fused: FusedLayers | None = None  # the fused kernels' path (``settings.fused``)
        self.columns = 0  # this rank's heads over all hooked layers: the stats table's width
        # internal request id -> probe key while the request still waits for its score, else None
        self.pending: dict[str, str | None] = {}
        self.fault_keys = fault_keys
        self.stops: Stops | None = None  # read once by the stop logits processor
        self.focus: DeviceFocus | None = None  # built by ``ready`` once every layer is hooked
        self.term_layers: list[int] = []
        self.fault_message = ""  # what a fault-injected request fails with (set by ``ready``)
        self._step: object = None
        self.rows = StepRows()
        self.probe_seconds = 0.0
        self.dispatcher: Any = None  # vLLM's CUDA-graph dispatcher, while wrapped
        self._rank_columns: torch.Tensor | None = None  # this rank's heads in the TP table
        self.head_order: list[list[int]] = []  # table_heads as sent with results (``ready``)
        self.staging = HostStaging(settings.device)  # the step's host arrays to the device
        self.store = ResultStore(settings.pp_size)  # results until popped, and their buffers

    def ready(self) -> None:
        """Called once the layers are hooked: fixes the table layout and the device focus."""
        first = min(self.layers, default=min(self.hidden, default=0))
        self.fault_message = injected_fault_message(first)
        self.term_layers = sorted(i for i, r in self.hidden.items() if r.last is not None or r.data)
        self.store.term_layers = self.term_layers
        self.head_order = [[layer, head] for layer, head in self.table_heads]
        column = 0
        for layer in self.layers.values():
            layer.column, column = column, column + len(layer.global_heads)
        self.columns = column
        config = self.config
        if config is not None and self.settings.pp_size == 1:
            self.focus = DeviceFocus(config, self.table_heads, self.term_layers, self.device)

    @property
    def device(self) -> Any:
        return self.settings.device

    @property
    def table_heads(self) -> list[HeadKey]:
        """The heads of the step's stats table, in column order (every rank's heads with tensor
        parallelism, once the ranks combined)."""
        if self.settings.tp_size > 1:
            return list(self.heads)
        return [(lay.index, h) for lay in self.layers.values() for h in lay.global_heads]

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

    def awaits_score(self, runner: Any) -> bool:
        """Whether a request of the current batch still waits for its score (then the step must
        run the probe's Python code: no full CUDA graph)."""
        return any(self._probe_key(runner, rid) for rid in runner.input_batch.req_ids)

    def plan(self, runner: Any, step: object, metadata: Any) -> StepRows:
        """Rows to score in this step: guarded requests whose last prompt token is computed now.

        ``step`` is the step's forward context: one object per model step, shared by all layers.
        """
        if step is self._step:
            return self.rows
        self._step, self.rows = step, StepRows()
        self.probe_seconds = 0.0
        self.stops = None
        batch_ids = runner.input_batch.req_ids
        pending = [(i, rid) for i, rid in enumerate(batch_ids) if self._probe_key(runner, rid)]
        if not pending:
            return self.rows
        starts, computed = batch_layout(runner, metadata)
        found = []
        for i, rid in pending:
            state = runner.requests[rid]
            last = state.num_prompt_tokens - 1
            first = int(computed[i])
            if not first <= last < first + int(starts[i + 1] - starts[i]):
                continue  # last prompt token not in this step (earlier chunk, or decode)
            self.pending[rid] = None  # scored once, even if preempted and recomputed later
            found.append((i, int(starts[i]) + last - first, state))
        if found:
            self.rows = plan_rows(
                found,
                metadata,
                self.settings.block_size,
                self.fault_keys,
                self.fault_message,
                self.staging,
                host_block_table(runner),
            )
            if self.needs_data_slots:  # the memo is read through the block table: check it
                check_slots(self.rows, metadata.slot_mapping)
            if self.fused is not None and self.rows.scored:
                self.fused.buffers(self.rows, self.columns)
        return self.rows

    # -- per layer -----------------------------------------------------------------------------
    def score_layer(
        self, layer: Layer, query: torch.Tensor, kv_cache: torch.Tensor, key: torch.Tensor
    ) -> None:
        """This layer's part of the step's stats, kept on the device: with the fused kernel its
        heads' stats, written into ``rows.stats``; otherwise its attention logits for every
        scored row ([rows, heads, tokens] float32), whose stats ``finish_step`` computes for all
        layers in one pass. The first hooked layer also checks the KV layout: the cached key of
        each row's last prompt token must be the key the layer computed."""
        rows = self.rows
        if not rows.scored:
            return
        fused = self.fused
        if fused is not None and rows.stash is not None and layer.slot >= 0:  # grouped
            if layer.index == self.first_layer:
                self._check_layout(rows, query, key, kv_cache)
            fused.stash(layer, rows, query, kv_cache)
            return
        assert rows.token_column is not None and rows.head_slots is not None
        tokens, heads = rows.head_slots.shape[2], len(layer.global_heads)
        if not heads:  # hooked only to finish in step with the other ranks
            rows.logits.append(query.new_zeros((rows.scored, 0, tokens), dtype=torch.float32))
            return
        dim = query.shape[-1]
        if layer.index == self.first_layer:
            self._check_layout(rows, query, key, kv_cache)
        queries = query.view(query.shape[0], -1, dim)  # [tokens, heads, dim]
        if fused is not None and rows.stats is not None:
            fused.layer_stats(layer, rows, query, kv_cache)
            return
        # one gather each: the scored heads' queries [K, h, dim], their keys [K, h, T, dim]
        q = queries[rows.token_column, layer.local_heads]
        chunk = max(1, CHUNK_ELEMENTS // max(tokens * heads * dim, 1))
        parts = []
        for lo in range(0, rows.scored, chunk):  # one pass unless the step is very large
            hi = lo + chunk
            keys = self.gather(kv_cache, rows.head_slots[lo:hi], layer.kv_heads)
            parts.append(
                batched_logits(q[lo:hi], keys, float(layer.impl.scale), layer.impl.logits_soft_cap)
            )
        rows.logits.append(parts[0] if len(parts) == 1 else torch.cat(parts))

    def _check_layout(
        self, rows: StepRows, query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor
    ) -> None:
        """Flag the rows whose cached key of the last prompt token is not the key the layer
        computed (the first hooked layer, every step)."""
        assert rows.token_rows is not None and rows.last_slots is not None
        dim = query.shape[-1]
        computed = key.view(key.shape[0], -1, dim).index_select(0, rows.token_rows)
        cached = self.gather(kv_cache, rows.last_slots)
        close = torch.isclose(cached.float(), computed.float(), rtol=1e-3, atol=1e-3)
        rows.flag(LAYOUT, ~close.flatten(1).all(1))

    # -- end of step ---------------------------------------------------------------------------
    def finish_step(self) -> None:
        """After the last hooked layer: focus and stop decisions on the device, then one
        non-blocking copy of the step's table to the host. With tensor parallelism every rank
        calls this in the same step (they hook the same layers) and the ranks combine their
        heads first, so each holds every head's stats."""
        rows, self.rows = self.rows, StepRows()
        focus = None
        table: dict[str, torch.Tensor] = {}
        if rows.scored:
            try:
                table, focus = self._device_table(rows)
            except Exception as exc:  # recorded for the step's rows, never raised into vLLM
                rows.fail_all(f"probe: {type(exc).__name__}: {exc}", ProbeErrorReason.PROBE)
                table, focus = {}, None
        self._decide_stops(rows, focus, table.get("flags"))
        if not self.store.discard:
            self._to_host(rows, table)
        if self.fused is not None and rows.stats is not None and not self.fused.tried:
            self.fused.form_group(list(self.layers.values()))

    def _to_host(self, rows: StepRows, table: dict[str, torch.Tensor]) -> None:
        """The step's table to the host in one non-blocking copy, into the store."""
        columns: dict[str, slice] = {}
        flat = []
        at = 0
        for name, part in table.items():
            part = part.reshape(rows.scored, -1)  # a view
            columns[name] = slice(at, at + part.shape[1])
            at += part.shape[1]
            flat.append(part)
        event = buffer = None
        if flat:
            device_table = torch.cat(flat, dim=1)  # one kernel: cat promotes the dtypes
            if device_table.dtype != torch.float64:  # no focus (float64) among them
                device_table = device_table.double()
            if device_table.device.type == "cuda":
                buffer = self.store.take_buffer(device_table.numel())
                host = buffer[: device_table.numel()].view(device_table.shape)
                host.copy_(device_table, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                host = device_table.cpu()
        else:
            host = torch.empty(0, 0, dtype=torch.float64)
        self.store.add(FinishedStep(rows, host, buffer, event, columns, self.probe_seconds))

    def pop(self, keys: list[str]) -> dict[str, ProbeResultData]:
        """Remove and return the stored results of ``keys`` (missing keys are absent)."""
        return self.store.pop(keys)

    def _device_table(self, rows: StepRows) -> tuple[dict[str, torch.Tensor], Any]:
        """The step's results as device tensors by name, and the focus (None: no stops)."""
        assert rows.flags is not None and rows.valid is not None
        assert rows.instruction is not None and rows.data is not None
        if rows.stats is not None:  # the fused kernels: the group's now, the others' already
            if rows.stash is not None and self.fused is not None:
                self.fused.group_stats(rows)
            stats = rows.stats
        else:
            logits = torch.cat(rows.logits, dim=1)  # [K, local heads of every layer, T]
            stats = stats_from_logits(logits, rows.valid, rows.instruction, rows.data)
        flags = rows.flags
        if self.settings.tp_size > 1:
            stats, flags = self._combine_ranks(stats, flags)
        # a layer whose read-out did not run in this step (no hook or tap fired) gives NaN: the
        # row fails (NONFINITE), never scored without the term
        terms = [
            rows.terms[layer]
            if layer in rows.terms
            else torch.full((rows.scored,), float("nan"), dtype=torch.float32, device=stats.device)
            for layer in self.term_layers
        ]
        term_table = torch.stack(terms, dim=1) if terms else stats.new_zeros(rows.scored, 0)
        if terms:
            flags[:, NONFINITE] |= ~torch.isfinite(term_table).all(1)
        table = {"stats": stats, "terms": term_table}
        for layer in sorted(rows.streams):
            table[f"stream{layer}"] = rows.streams[layer]
        for layer in sorted(rows.mean_streams):
            table[f"mean{layer}"] = rows.mean_streams[layer]
        focus = None
        if self.focus is not None and rows.stop_rows:  # the focus decides armed rows only
            focus = self.focus(stats, term_table)
            table["focus"] = focus
        table["flags"] = flags
        return table, focus

    def _combine_ranks(
        self, stats: torch.Tensor, flags: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's heads for every row, by one all-reduce over the tensor-parallel group:
        each rank writes its own heads into a zeroed table (x + 0 is exact, so the sum equals
        the values) and its failure flags; a row that failed on any rank fails on all."""
        from vllm.distributed import tensor_model_parallel_all_reduce

        if self._rank_columns is None:  # built once: a device tensor from a list synchronises
            index = {head: i for i, head in enumerate(self.heads)}
            mine = [index[(lay.index, h)] for lay in self.layers.values() for h in lay.global_heads]
            self._rank_columns = torch.tensor(mine, dtype=torch.long, device=stats.device)
        rows = stats.shape[0]
        table = stats.new_zeros(rows, len(self.heads), WIDTH)
        table[:, self._rank_columns] = stats
        failed = flags.any(1, keepdim=True).float()
        both = torch.cat([table.flatten(1), failed], dim=1)
        both = tensor_model_parallel_all_reduce(both)
        flags = flags.clone()
        flags[:, OTHER_RANK] = both[:, -1] > 0
        return both[:, :-1].view(rows, len(self.heads), WIDTH), flags

    def _decide_stops(self, rows: StepRows, focus: Any, flags: torch.Tensor | None) -> None:
        """Early stop: a request whose focus is at or below its ``stop_below`` ends right after
        prefill (its first sampled token is forced to its stop token); one that could not be
        scored, by its ``stop_on_error``. Decided on the device, from the facts the plan copied
        there (``StepRows.stop_facts``): no host work and no copy here."""
        if self.settings.pp_size > 1 or not rows.stop_rows:
            return
        assert rows.stop_facts is not None and rows.stop_thresholds is not None
        index, tokens, on_failure, table_row = rows.stop_facts.unbind(0)
        stop = on_failure.bool()
        if focus is not None and flags is not None:  # the table's rows: scored, unless flagged
            at = table_row.clamp(min=0)
            scored = (table_row >= 0) & ~flags.index_select(0, at).any(1)
            below = focus.index_select(0, at) <= rows.stop_thresholds.to(focus.dtype)
            stop = torch.where(scored, below, stop)
        self.stops = Stops([rows.batch_index[i] for i in rows.stop_rows], index, tokens, stop)


def make_probe_forward(probe: Probe, layer: Layer, runner: Any) -> Any:
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
        except Exception as exc:  # a bug here must not take the engine down
            message = f"layer {layer.index}: {type(exc).__name__}: {exc}"
            probe.rows.fail_all(message, ProbeErrorReason.LAYER)
        probe.probe_seconds += time.perf_counter() - started
        if probe.rows and layer.index == probe.last_layer and not probe.finish_on_hidden:
            probe.finish_step()  # reached on every rank alike: tensor-parallel ranks combine here
        return out

    return forward


def install_probe(
    runner: Any,
    attention_layers: dict[int, Any],
    heads: list[tuple[int, int]],
    info: dict[str, Any],
    fault_keys: set[str],
    config: ModelProbeConfig | None,
    raw_hidden_layers: list[int] | None = None,
    raw_data_mean_layers: list[int] | None = None,
) -> Probe:
    """Wrap ``impl.forward`` of every attention layer holding one of ``heads`` (global indices;
    this rank scores those among its own query heads); ``config`` combines head scores into the
    focus, for early stops. With tensor parallelism every rank hooks the same layers, also those
    where it holds none of the heads, so all ranks finish a step's probe together (the residual
    stream between layers is the same on every rank). The decoder layers of ``config.hidden``
    and ``raw_hidden_layers`` / ``raw_data_mean_layers`` (whose whole stream at the last prompt
    token / averaged over the data tokens is returned: calibration) are hooked too."""
    per_rank = info["num_heads"] // info["tp_size"]
    lo = info["tp_rank"] * per_rank
    # With pipeline parallelism this stage holds some layers only: it scores their heads, and
    # the caller merges the stages' results (early stops need every layer: refused by the caller).
    heads = [(layer, head) for layer, head in heads if layer in attention_layers]
    by_layer: dict[int, list[int]] = {}
    for layer_index, head in heads:
        local = by_layer.setdefault(layer_index, [])
        if lo <= head < lo + per_rank:
            local.append(head)
    # one backend serves every layer: its key reader (refused here if it has none) and view
    gather: KeyGather = _no_gather
    key_view = None
    if by_layer:
        first = attention_layers[min(by_layer)]
        backend = (type(first.impl).__name__, getattr(first, "isa", None))
        gather, key_view = key_gather_for(*backend), key_view_for(*backend)
    settings = ProbeSettings(
        block_size=info["block_size"],
        tp_size=info["tp_size"],
        pp_size=info["pp_size"],
        device=runner.device,
        fused=key_view is not None and fused_available(runner.device),
    )
    probe = Probe(heads, fault_keys, settings, config)
    probe.gather = gather
    if settings.fused and key_view is not None:
        probe.fused = FusedLayers(key_view, probe.staging, settings.device)
    for layer_index, global_heads in sorted(by_layer.items()):
        module = attention_layers[layer_index]
        local_kv = int(getattr(module.impl, "num_kv_heads", info["num_kv_heads"]))
        host_heads = [h - lo for h in global_heads]
        host_kv_heads = [h // (per_rank // local_kv) for h in host_heads]  # GQA
        layer = Layer(
            layer_index,
            torch.tensor(host_heads, dtype=torch.long, device=runner.device),
            # as a column: it indexes (head, position) pairs of the key gather
            torch.tensor(host_kv_heads, dtype=torch.long, device=runner.device)[:, None],
            global_heads,
            module.impl,
            module.impl.forward,
            "forward" in vars(module.impl),
            host_heads=host_heads,
            host_kv_heads=host_kv_heads,
        )
        module.impl.forward = make_probe_forward(probe, layer, runner)
        probe.layers[layer_index] = layer
    # the first layer where this rank scores heads checks the layout (with tensor parallelism a
    # rank may hold none of a layer's probed heads)
    probe.first_layer = min((i for i, lay in probe.layers.items() if lay.global_heads), default=-1)
    probe.last_layer = max(probe.layers, default=-1)
    install_hidden(probe, runner, info, config, raw_hidden_layers or [], raw_data_mean_layers or [])
    probe.ready()
    _no_full_graph_while_scoring(probe, runner)
    return probe


def _no_full_graph_while_scoring(probe: Probe, runner: Any) -> None:
    """Never let a step that computes a guarded request's last prompt token replay a full CUDA
    graph, where no Python (so no probe) runs. vLLM replays one for a step in which every
    request has one scheduled token: a decode batch, or a prompt served from the prefix cache up
    to its last token. Such a step runs piecewise instead (the probe's wrapper runs between the
    pieces) through the dispatcher's own ``invalid_modes``, the way vLLM itself excludes full
    graphs for cascade attention; the steps after it replay full graphs as before."""
    dispatcher = getattr(runner, "cudagraph_dispatcher", None)
    if dispatcher is None or "dispatch" in vars(dispatcher):
        return
    from vllm.config import CUDAGraphMode

    original = dispatcher.dispatch

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        try:
            valid = kwargs.get("valid_modes")
            if (valid is None or set(valid) - {CUDAGraphMode.FULL}) and probe.awaits_score(runner):
                kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | {
                    CUDAGraphMode.FULL
                }
        except Exception:  # never break vLLM's dispatch; plan() records what fails later
            pass
        return original(*args, **kwargs)

    dispatcher.dispatch = dispatch
    probe.dispatcher = dispatcher


def uninstall_probe(probe: Probe) -> None:
    """Put every wrapped ``impl.forward`` back: the engine runs exactly as before."""
    probe.fused = None  # drops the group's references to the KV caches
    for layer in probe.layers.values():
        layer.cache = None
        if layer.had_instance_forward:
            layer.impl.forward = layer.original_forward
        else:
            del layer.impl.forward  # back to the class's method
    for reader in probe.hidden.values():
        reader.handle.remove()
    probe.hidden.clear()
    if probe.dispatcher is not None:
        del probe.dispatcher.dispatch  # back to the class's method
        probe.dispatcher = None
