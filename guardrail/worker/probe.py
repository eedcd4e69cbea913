"""The attention probe inside vLLM's worker: plan each step, score each hooked layer, store.

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

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.kv_layout import KeyGather, key_gather_for
from guardrail.probe.scoring import ATTENTION_STATS, HeadKey, head_attention_stats, spans_to_mask
from guardrail.protocol import MAX_STORED_RESULTS, PROBE_ARG, ProbeResultData, ProbeSpec
from guardrail.worker.hidden import HiddenReader, install_hidden

__all__ = [
    "PROBES",
    "Layer",
    "Probe",
    "install_probe",
    "make_probe_forward",
    "uninstall_probe",
]

Streams = dict[int, list[float]]  # layer -> a raw stream

PROBES: dict[int, Probe] = {}
"""The probe of each engine in this process, by id() of the engine's VllmConfig: the stop
logits processor (``guardrail.worker.stop``) is built by vLLM before the probe is installed,
and finds it here."""


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
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> logit term, 0-d
    streams: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> raw stream
    mean_streams: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> data mean
    data_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    error: str | None = None
    stop_below: float | None = None
    stop_on_error: bool = True


@dataclass
class Layer:
    index: int
    local_heads: torch.Tensor  # query heads of this rank to score, local indices
    global_heads: list[int]
    impl: Any
    original_forward: Any
    had_instance_forward: bool


class Probe:
    """Probe state of one worker: hooked layers, the current step's plan, finished results."""

    def __init__(self, heads: list[tuple[int, int]], fault_keys: set[str]) -> None:
        self.heads = heads
        self.layers: dict[int, Layer] = {}
        self.hidden: dict[int, HiddenReader] = {}
        self.last_layer = -1  # the step's probe finishes after this layer's attention ...
        self.finish_on_hidden = False  # ... or after this decoder layer's output
        self.gather: KeyGather = _no_gather
        self.results: OrderedDict[str, ProbeResultData] = OrderedDict()
        # internal request id -> probe key while the request still waits for its score, else None
        self.pending: dict[str, str | None] = {}
        self.fault_keys = fault_keys
        self.stop_keys: set[str] = set()  # keys whose next sampled token must be the stop token
        self._step: object = None
        self.rows: list[_Row] = []
        self.probe_seconds = 0.0

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
            return self.rows
        self._step, self.rows = step, []
        self.probe_seconds = 0.0
        batch_ids = runner.input_batch.req_ids
        pending = [(i, rid) for i, rid in enumerate(batch_ids) if self._probe_key(runner, rid)]
        if not pending:
            return self.rows
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        for i, rid in pending:
            state = runner.requests[rid]
            num_prompt = state.num_prompt_tokens
            first_pos = seq_lens[i] - (starts[i + 1] - starts[i])
            if not first_pos <= num_prompt - 1 < seq_lens[i]:
                continue  # last prompt token not in this step (earlier chunk, or decode)
            self.pending[rid] = None  # scored once, even if preempted and recomputed later
            self.rows.append(
                self._make_row(state, i, starts[i] + num_prompt - 1 - first_pos, metadata)
            )
        return self.rows

    def _make_row(self, state: Any, batch_index: int, token_row: int, metadata: Any) -> _Row:
        spec: ProbeSpec = state.sampling_params.extra_args[PROBE_ARG]
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
            row.instruction_mask = spans_to_mask(
                [(a, b) for a, b in spec["instruction"]], n, device
            )
            row.data_mask = spans_to_mask([(a, b) for a, b in spec["data"]], n, device)
            if spec.get("num_prompt_tokens", n) != n:
                raise ValueError(
                    f"engine saw {n} prompt tokens, request spans were made for "
                    f"{spec['num_prompt_tokens']}"
                )
            if self.needs_data_slots:
                row.data_slots = self._data_slots(row, metadata)
        except Exception as exc:  # recorded for this request, never raised into the engine
            row.error = f"plan: {type(exc).__name__}: {exc}"
        return row

    def _data_slots(self, row: _Row, metadata: Any) -> torch.Tensor:
        """The KV slots of the request's data tokens (where the hidden memo holds their
        projections), checked against the slot vLLM wrote the last prompt token to."""
        bs = self.block_size
        positions = torch.arange(row.num_prompt_tokens, device=row.data_mask.device)
        positions = positions[row.data_mask]
        slots = row.block_ids.long()[positions // bs] * bs + positions % bs
        last = row.num_prompt_tokens - 1
        expected = int(row.block_ids[last // bs]) * bs + last % bs
        if expected != int(metadata.slot_mapping[row.token_row]):
            raise RuntimeError(
                "KV slot layout check failed: the last prompt token's slot from the block table "
                "differs from the slot vLLM wrote it to"
            )
        return slots

    # -- per layer -----------------------------------------------------------------------------
    def score_layer(
        self, layer: Layer, query: torch.Tensor, kv_cache: torch.Tensor, key: torch.Tensor
    ) -> None:
        for row in self.rows:
            if row.error is not None:
                continue
            try:
                if row.key in self.fault_keys:
                    raise RuntimeError("fault injected for testing")
                if not layer.global_heads:  # hooked only to finish in step with the other ranks
                    width = len(ATTENTION_STATS)
                    row.scores.append(query.new_empty((0, width), dtype=torch.float32))
                    continue
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

    def kv_index(self, layer: Layer, local_kv_heads: int) -> torch.Tensor:
        group = self.local_num_heads // local_kv_heads
        return torch.div(layer.local_heads, group, rounding_mode="floor")

    def finish_step(self) -> None:
        """After the last hooked layer: one transfer for all rows, results stored by key. With
        tensor parallelism every rank calls this in the same step (they hook the same layers)
        and the ranks combine their heads first, so each holds every head's stats."""
        rows, self.rows = self.rows, []
        stats = self._row_stats(rows)
        if self.tp_size > 1:
            stats = self._combine_ranks(rows, stats)
        hidden = self._row_hidden(rows)
        latency = self.probe_seconds
        for row, scores, (terms, streams, means) in zip(rows, stats, hidden, strict=True):
            result: ProbeResultData = {
                "num_prompt_tokens": row.num_prompt_tokens,
                "probe_seconds": latency / max(len(rows), 1),
            }
            if row.error is None and not all(map(math.isfinite, terms.values())):
                row.error = (
                    "hidden: a logit term is not finite (a data token's stream was never "
                    "computed in this process: KV loaded without a forward pass?)"
                )
            if row.error is None and scores is not None:
                result["heads"] = [[lay, h, s] for (lay, h), s in scores.items()]
                if terms:
                    result["hidden"] = [[lay, t] for lay, t in terms.items()]
                if streams:
                    result["hidden_states"] = [[lay, x] for lay, x in streams.items()]
                if means:
                    result["data_mean_states"] = [[lay, x] for lay, x in means.items()]
            else:
                result["error"] = row.error or "probe: no score"
            self._decide_stop(row, result, scores if row.error is None else None, terms)
            self.results[row.key] = result
        while len(self.results) > MAX_STORED_RESULTS:
            self.results.popitem(last=False)

    def _row_stats(self, rows: list[_Row]) -> list[dict[HeadKey, list[float]] | None]:
        """This rank's head stats per row (None for a row that failed), in one transfer."""
        heads = [(lay.index, h) for lay in self.layers.values() for h in lay.global_heads]
        ok = [r for r in rows if r.error is None]
        values = torch.cat([torch.cat(r.scores) for r in ok]).tolist() if ok else []
        stats: list[dict[HeadKey, list[float]] | None] = []
        offset = 0
        for row in rows:
            if row.error is not None:
                stats.append(None)
                continue
            stats.append(dict(zip(heads, values[offset : offset + len(heads)], strict=True)))
            offset += len(heads)
        return stats

    def _row_hidden(self, rows: list[_Row]) -> list[tuple[dict[int, float], Streams, Streams]]:
        """Each row's hidden-state logit terms, raw last-token streams and raw data-mean
        streams, in one transfer."""
        if not self.hidden:
            return [({}, {}, {}) for _ in rows]
        flat: list[torch.Tensor] = []
        for row in rows:
            if row.error is None:
                flat += [row.hidden[lay].reshape(1) for lay in sorted(row.hidden)]
                flat += [row.streams[lay] for lay in sorted(row.streams)]
                flat += [row.mean_streams[lay] for lay in sorted(row.mean_streams)]
        values = torch.cat(flat).tolist() if flat else []
        out: list[tuple[dict[int, float], Streams, Streams]] = []
        offset = 0
        for row in rows:
            terms: dict[int, float] = {}
            streams: Streams = {}
            means: Streams = {}
            if row.error is None:
                for lay in sorted(row.hidden):
                    terms[lay] = values[offset]
                    offset += 1
                for target, source in ((streams, row.streams), (means, row.mean_streams)):
                    for lay in sorted(source):
                        size = source[lay].numel()
                        target[lay] = values[offset : offset + size]
                        offset += size
            out.append((terms, streams, means))
        return out

    def _combine_ranks(
        self, rows: list[_Row], stats: list[dict[HeadKey, list[float]] | None]
    ) -> list[dict[HeadKey, list[float]] | None]:
        """Every rank's heads for every row, by one all-reduce over the tensor-parallel group:
        each rank writes its own heads into a zeroed table (x + 0 is exact, so the sum equals
        the values) and a failure flag; a row that failed on any rank fails on all."""
        from vllm.distributed import tensor_model_parallel_all_reduce

        index = {head: i for i, head in enumerate(self.heads)}
        width = len(ATTENTION_STATS)
        table = torch.zeros(len(rows), len(self.heads) * width + 1, dtype=torch.float32)
        for r, got in enumerate(stats):
            if got is None:
                table[r, -1] = 1.0
                continue
            for head, values in got.items():
                i = index[head]
                table[r, i * width : (i + 1) * width] = torch.tensor(values)
        table = tensor_model_parallel_all_reduce(table.to(self.device)).cpu()
        combined: list[dict[HeadKey, list[float]] | None] = []
        for r, row in enumerate(rows):
            if table[r, -1].item() > 0:
                row.error = row.error or "probe: another tensor-parallel rank failed to score"
                combined.append(None)
                continue
            per_head: list[list[float]] = table[r, :-1].view(len(self.heads), width).tolist()
            combined.append({head: per_head[i] for head, i in index.items()})
        return combined

    def _decide_stop(
        self,
        row: _Row,
        result: ProbeResultData,
        scores: dict[HeadKey, list[float]] | None,
        hidden: dict[int, float],
    ) -> None:
        """Early stop: a request whose focus is at or below its ``stop_below`` ends right after
        prefill (its first sampled token is forced to its stop token)."""
        if row.stop_below is None or self.pp_size > 1:
            return
        if scores is None or self.config is None:
            stop = row.stop_on_error
        else:
            try:
                focus = self.config.focus(scores, hidden)
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
    tp_size: int = 1
    pp_size: int = 1
    device: Any = "cpu"
    config: ModelProbeConfig | None = None  # combines head scores into the focus (stops)
    needs_data_slots: bool = False  # a hidden reader averages over the data tokens


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
            for row in probe.rows:
                row.error = row.error or f"probe: {type(exc).__name__}: {exc}"
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
    probe = Probe(heads, fault_keys)
    probe.block_size, probe.local_num_heads, probe.config = info["block_size"], per_rank, config
    probe.tp_size, probe.pp_size, probe.device = info["tp_size"], info["pp_size"], runner.device
    by_layer: dict[int, list[int]] = {}
    for layer_index, head in heads:
        local = by_layer.setdefault(layer_index, [])
        if lo <= head < lo + per_rank:
            local.append(head)
    for layer_index, global_heads in sorted(by_layer.items()):
        module = attention_layers[layer_index]
        probe.gather = key_gather_for(type(module.impl).__name__, getattr(module, "isa", None))
        layer = Layer(
            layer_index,
            torch.tensor([h - lo for h in global_heads], device=runner.device),
            global_heads,
            module.impl,
            module.impl.forward,
            "forward" in vars(module.impl),
        )
        module.impl.forward = make_probe_forward(probe, layer, runner)
        probe.layers[layer_index] = layer
    probe.last_layer = max(probe.layers, default=-1)
    install_hidden(probe, runner, info, config, raw_hidden_layers or [], raw_data_mean_layers or [])
    return probe


def uninstall_probe(probe: Probe) -> None:
    """Put every wrapped ``impl.forward`` back: the engine runs exactly as before."""
    for layer in probe.layers.values():
        if layer.had_instance_forward:
            layer.impl.forward = layer.original_forward
        else:
            del layer.impl.forward  # back to the class's method
    for reader in probe.hidden.values():
        reader.handle.remove()
    probe.hidden.clear()
