"""The rows a step scores: host facts read once per step, device tensors built once per step.

A request is scored in the step that computes its last prompt token. The step's plan is made by
the first hooked layer that runs (``Probe.plan``): it reads the batch layout from the model
runner's host-side buffers (no synchronisation with the device), validates each request's spans
on the host (a bad request fails alone, here), and builds, for the rows that can be scored,
padded ``[rows, tokens]`` tensors that every hooked layer then reuses: the token masks, and the
KV slot of every prompt position, through the request's block table, so prefix-cached blocks
and earlier chunked-prefill steps are read like fresh ones.

Failures found on the device (a KV layout or slot check, a non-finite hidden term) are flags in
``StepRows.flags``, carried to the host with the results, never a synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from guardrail.protocol import PROBE_ARG, ProbeErrorReason, ProbeSpec

__all__ = [
    "FLAG_MESSAGES",
    "FLAG_REASONS",
    "HostStaging",
    "PinnedTables",
    "StepRows",
    "batch_layout",
    "check_slots",
    "host_block_table",
    "plan_rows",
]

FLAG_MESSAGES = (
    "probe: KV cache layout check failed: cached key of the last prompt token differs from the "
    "key the layer computed",
    "plan: KV slot layout check failed: the last prompt token's slot from the block table "
    "differs from the slot vLLM wrote it to",
    "hidden: a logit term is missing or not finite (a read decoder layer's hook or tap did not "
    "run in this step, or a data token's stream was never computed in this process: KV loaded "
    "without a forward pass?)",
    "probe: another tensor-parallel rank failed to score",
)
"""What each column of ``StepRows.flags`` means, as the row's error."""
FLAG_REASONS = (
    ProbeErrorReason.PROBE,
    ProbeErrorReason.PLAN,
    ProbeErrorReason.HIDDEN,
    ProbeErrorReason.PROBE,
)
"""The ``ProbeErrorReason`` of each column of ``StepRows.flags``."""
LAYOUT, SLOT, NONFINITE, OTHER_RANK = range(len(FLAG_MESSAGES))


@dataclass
class StepRows:
    """The rows scored in one step. Host lists cover every row; device tensors cover the rows
    in ``ok`` (those without a host-side error), in that order."""

    keys: list[str] = field(default_factory=list)
    tags: list[str | None] = field(default_factory=list)  # the specs' ``tag`` (pushed results)
    batch_index: list[int] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    reasons: list[ProbeErrorReason | None] = field(default_factory=list)  # one per ``errors``
    stop_below: list[float | None] = field(default_factory=list)
    stop_on_error: list[bool] = field(default_factory=list)
    stop_token: list[int | None] = field(default_factory=list)
    has_data: list[bool] = field(default_factory=list)
    positions: list[list[int] | None] = field(default_factory=list)  # ``stream_positions``
    ok: list[int] = field(default_factory=list)
    token_rows: torch.Tensor | None = None  # [K] row of the last prompt token in the batch
    token_column: torch.Tensor | None = None  # [K, 1] the same, to index (row, head) pairs
    valid: torch.Tensor | None = None  # [K, T] bool: position < the row's prompt length
    instruction: torch.Tensor | None = None  # [K, T] bool
    data: torch.Tensor | None = None  # [K, T] bool
    slots: torch.Tensor | None = None  # [K, T] long: KV slot of every position
    head_slots: torch.Tensor | None = None  # [K, 1, T] the same, to index (row, head, position)
    last_slots: torch.Tensor | None = None  # [K] long: KV slot of the last prompt token
    lengths: torch.Tensor | None = None  # [K] long: prompt tokens of the row
    stats: torch.Tensor | None = None  # [K, local heads of every layer, 5]: the fused kernel's
    # [stash slots, K, heads, dim]: each grouped layer's queries at the rows' ``token_rows``,
    # read by the fused kernel of the whole layer group at the end of the step
    stash: torch.Tensor | None = None
    stash_slots: tuple[torch.Tensor, ...] = ()  # ``stash.unbind(0)``: each grouped layer's part
    flags: torch.Tensor | None = None  # [K, len(FLAG_MESSAGES)] bool
    logits: list[torch.Tensor] = field(default_factory=list)  # per hooked layer [K, heads, T]
    terms: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [K] logit term
    streams: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [K, hidden]
    mean_streams: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [K, hidden]
    # layer -> {row (host index): [positions, hidden] float32 on the host} (``positions``)
    token_states: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    # the early stop's rows (a ``stop_below`` and a stop token; host indices), and their facts on
    # the device, copied with the plan: [4, S] long (batch index, stop token, stop when not
    # scored, row in the step's table or -1) and [S] float64 ``stop_below``
    stop_rows: list[int] = field(default_factory=list)
    stop_facts: torch.Tensor | None = None
    stop_thresholds: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def scored(self) -> int:
        """How many rows the device scores."""
        return len(self.ok)

    def armed(self, i: int) -> bool:
        """Whether row ``i`` may be stopped after prefill: a ``stop_below`` and a stop token."""
        return self.stop_below[i] is not None and self.stop_token[i] is not None

    def flag(self, column: int, failed: torch.Tensor) -> None:
        """Mark rows (``failed`` [K] bool, on the device) as failed for reason ``column``."""
        assert self.flags is not None
        self.flags[:, column] |= failed

    def fail_all(self, message: str, reason: ProbeErrorReason) -> None:
        """Every row of the step fails with ``message`` and ``reason`` (an error in the batched
        code); a row that had already failed keeps its own."""
        for i, error in enumerate(self.errors):
            if error is None:
                self.errors[i], self.reasons[i] = message, reason
        self.ok = []


def batch_layout(runner: Any, metadata: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(query_start_loc [reqs + 1], first position computed in this step [reqs])`` on the
    host, from the model runner's host-side buffers (what it built the step's metadata from);
    where a runner has none, from the metadata (one copy to the host per step)."""
    starts = getattr(getattr(runner, "query_start_loc", None), "np", None)
    computed = getattr(runner.input_batch, "num_computed_tokens_cpu", None)
    num_reqs = len(runner.input_batch.req_ids)
    if starts is not None and computed is not None:
        return starts[: num_reqs + 1], computed[:num_reqs]
    both = torch.cat([metadata.query_start_loc, metadata.seq_lens]).tolist()
    qsl = np.asarray(both[: num_reqs + 1])
    seq_lens = np.asarray(both[-len(metadata.seq_lens) :][:num_reqs])
    return qsl, seq_lens - np.diff(qsl)


def _spec_error(spec: ProbeSpec, n: int) -> str | None:
    """Why the request's spans do not fit its prompt (a ``PLAN`` error), or None."""
    if spec.get("num_prompt_tokens", n) != n:
        return (
            f"plan: ValueError: engine saw {n} prompt tokens, request spans were made for "
            f"{spec['num_prompt_tokens']}"
        )
    for name in ("instruction", "data"):
        for span in spec[name]:
            if len(span) != 2 or not 0 <= span[0] <= span[1] <= n:
                return f"plan: ValueError: {name} span {span} outside the prompt's {n} tokens"
    bad = [p for p in spec.get("stream_positions", []) if not 0 <= p < n]
    if bad:
        return f"plan: ValueError: stream positions {bad[:5]} outside the prompt's {n} tokens"
    return None


def plan_rows(
    found: list[tuple[int, int, Any]],
    metadata: Any,
    block_size: int,
    faults: set[str],
    fault_message: str,
    staging: HostStaging,
    host_table: np.ndarray | None = None,
) -> StepRows:
    """The step's rows from ``found`` = [(batch index, token row of the last prompt token,
    vLLM's request state)], with their device tensors built from one copy. A request
    whose key is in ``faults`` fails with ``fault_message`` as a hooked layer would (``LAYER``)."""
    rows = StepRows()
    for batch_index, _, state in found:
        spec: ProbeSpec = state.sampling_params.extra_args[PROBE_ARG]
        n = int(state.num_prompt_tokens)
        error = _spec_error(spec, n)
        reason = None if error is None else ProbeErrorReason.PLAN
        if error is None and spec["key"] in faults:
            error, reason = fault_message, ProbeErrorReason.LAYER
        rows.keys.append(spec["key"])
        tag = spec.get("tag")
        rows.tags.append(tag if isinstance(tag, str) else None)
        rows.batch_index.append(batch_index)
        rows.num_prompt_tokens.append(n)
        rows.errors.append(error)
        rows.reasons.append(reason)
        rows.stop_below.append(spec.get("stop_below"))
        rows.stop_on_error.append(spec.get("stop_on_error", True))
        token = spec.get("stop_token")
        rows.stop_token.append(None if token is None else int(token))
        rows.has_data.append(any(b > a for a, b in spec["data"]))
        rows.positions.append(spec.get("stream_positions"))
        if error is None:
            rows.ok.append(len(rows.keys) - 1)
        if rows.armed(len(rows.keys) - 1):
            rows.stop_rows.append(len(rows.keys) - 1)
    if rows.ok:
        _device_tensors(rows, found, metadata, block_size, staging, host_table)
    elif rows.stop_rows:  # every row failed here: the stops' facts alone
        _stop_views(rows, staging.to_device(_stop_section(rows)))
    return rows


def _stop_section(rows: StepRows) -> np.ndarray:
    """The early stop's facts of ``rows.stop_rows`` as int64 [5 * S]: batch index, stop token,
    stop when not scored, row in the step's table (-1: not scored), then ``stop_below`` as
    float64 bits (``_stop_views`` reads them back)."""
    table_row = {i: r for r, i in enumerate(rows.ok)}
    wanted = rows.stop_rows
    section = np.empty(5 * len(wanted), dtype=np.int64)
    facts = section[: 4 * len(wanted)].reshape(4, -1)
    facts[0] = [rows.batch_index[i] for i in wanted]
    facts[1] = np.array([rows.stop_token[i] for i in wanted], dtype=np.int64)  # none is None
    facts[2] = [rows.stop_on_error[i] for i in wanted]
    facts[3] = [table_row.get(i, -1) for i in wanted]
    section[4 * len(wanted) :].view(np.float64)[:] = [rows.stop_below[i] for i in wanted]
    return section


def _stop_views(rows: StepRows, section: torch.Tensor) -> None:
    """Point ``rows.stop_facts`` and ``rows.stop_thresholds`` at ``section``, the values of
    ``_stop_section`` on the device."""
    n = len(rows.stop_rows)
    rows.stop_facts = section[: 4 * n].view(4, n)
    rows.stop_thresholds = section[4 * n :].view(torch.float64)


class HostStaging:
    """Copies of a step's small host arrays to the device that never synchronise and never pin
    new memory: on CUDA each copy goes through one of ``SLOTS`` pinned buffers, used in turn and
    kept (pinning fresh memory each step, as ``Tensor.pin_memory()`` does for new sizes, costs
    milliseconds), and a buffer is written again only once the copy it last fed has run (its
    event: ``SLOTS`` copies later, which a step makes at most three of, so in practice it has).
    ``torch.tensor(list, device=cuda)`` would instead wait for every kernel queued before it."""

    SLOTS = 8

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self._events: list[Any] = [None] * self.SLOTS
        self._turn = 0

    def to_device(self, values: np.ndarray) -> torch.Tensor:
        """``values`` on the device (a new tensor, same dtype and shape)."""
        if self.device.type != "cuda":
            return torch.from_numpy(values).to(self.device)
        values = np.ascontiguousarray(values)
        slot, self._turn = self._turn, (self._turn + 1) % self.SLOTS
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # the copy SLOTS calls ago: long done
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < values.nbytes:
            size = max(values.nbytes, 2 * (0 if buffer is None else buffer.numel()), 1 << 16)
            buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host = buffer[: values.nbytes]
        host.numpy()[:] = values.reshape(-1).view(np.uint8)
        out = host.to(self.device, non_blocking=True)
        event = self._events[slot]
        if event is None:  # one per slot, recorded again at each use
            event = self._events[slot] = torch.cuda.Event()
        event.record()
        dtype = torch.from_numpy(np.empty(0, dtype=values.dtype)).dtype
        return out.view(dtype).view(values.shape)


class PinnedTables:
    """Pinned host buffers for the step tables copied back from the device, reused: pinning
    fresh memory every step costs milliseconds. A buffer handed out by ``take`` comes back by
    ``give`` once its values were read."""

    KEPT = 8

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, size: int) -> torch.Tensor:
        """A flat pinned float64 host tensor of at least ``size`` elements (contents undefined)."""
        for i, buffer in enumerate(self._free):
            if buffer.numel() >= size:
                return self._free.pop(i)
        return torch.empty(max(size, 1 << 12), dtype=torch.float64, pin_memory=True)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from ``take`` for reuse (at most ``KEPT`` are kept)."""
        if len(self._free) < self.KEPT:
            self._free.append(buffer)


def host_block_table(runner: Any) -> np.ndarray | None:
    """The model runner's host copy of the block table (the one it copies to the device for the
    step), where the engine has one KV cache group; None otherwise (the device table is read)."""
    tables = getattr(getattr(runner.input_batch, "block_table", None), "block_tables", None)
    if not isinstance(tables, list) or len(tables) != 1:
        return None
    host = getattr(getattr(tables[0], "block_table", None), "np", None)
    return host if isinstance(host, np.ndarray) else None


def _device_tensors(
    rows: StepRows,
    found: list[tuple[int, int, Any]],
    metadata: Any,
    block_size: int,
    staging: HostStaging,
    host_table: np.ndarray | None,
) -> None:
    """Masks, indices, KV slots and zeroed flags of the scored rows, in one host-to-device copy:
    the slots come from the runner's host block table (``host_table``), or, without one, from
    the device's in a few kernels. Everything else on the device is a view of that copy."""
    ok = rows.ok
    k = len(ok)
    width = max(rows.num_prompt_tokens[i] for i in ok)
    blocks_per_row = (width + block_size - 1) // block_size
    # bytes: masks [3, K, T] and flags [K, flags] (bool), padded to 8, then int64: per row
    # batch index, token row, last position, prompt length; then KV slots [K, T] and the last
    # prompt token's slot [K] where the host has the block table; then the early stop's facts
    mask_bytes = 3 * k * width
    flag_bytes = k * len(FLAG_MESSAGES)
    at = -(-(mask_bytes + flag_bytes) // 8) * 8
    stops = 5 * len(rows.stop_rows)
    longs = 4 * k + (k * width + k if host_table is not None else 0) + stops
    packed = np.zeros(at + 8 * longs, dtype=np.uint8)
    _fill_masks(packed[:mask_bytes].view(np.bool_).reshape(3, k, width), rows, found)
    ints = packed[at:].view(np.int64)
    batch = np.array([rows.batch_index[i] for i in ok], dtype=np.int64)
    last = np.array([rows.num_prompt_tokens[i] - 1 for i in ok], dtype=np.int64)
    ints[:k] = batch
    ints[k : 2 * k] = [found[i][1] for i in ok]
    ints[2 * k : 3 * k] = last
    ints[3 * k : 4 * k] = last + 1
    if host_table is not None:
        blocks = host_table[batch, :blocks_per_row].astype(np.int64)
        offsets = np.arange(block_size, dtype=np.int64)
        slots = (blocks[:, :, None] * block_size + offsets).reshape(k, -1)[:, :width]
        ints[4 * k : 4 * k + k * width] = slots.reshape(-1)
        ints[4 * k + k * width : longs - stops] = slots[np.arange(k), last]
    if stops:
        ints[longs - stops :] = _stop_section(rows)
    on_device = staging.to_device(packed)
    masks_d = on_device[:mask_bytes].view(torch.bool).view(3, k, width)
    rows.valid, rows.instruction, rows.data = masks_d.unbind(0)
    rows.flags = on_device[mask_bytes : mask_bytes + flag_bytes].view(torch.bool).view(k, -1)
    ints_d = on_device[at:].view(torch.int64)
    index_d = ints_d[: 4 * k].view(4, k)
    batch_d, rows.token_rows, last_d, rows.lengths = index_d.unbind(0)
    rows.token_column = rows.token_rows[:, None]
    if stops:
        _stop_views(rows, ints_d[longs - stops :])
    if host_table is not None:
        rows.slots = ints_d[4 * k : 4 * k + k * width].view(k, width)
        rows.last_slots = ints_d[4 * k + k * width : longs - stops]
    else:
        rows.slots = _device_slots(metadata.block_table, batch_d, width, block_size)
        rows.last_slots = rows.slots.gather(1, last_d[:, None])[:, 0]
    rows.head_slots = rows.slots[:, None, :]


def _fill_masks(masks: np.ndarray, rows: StepRows, found: list[tuple[int, int, Any]]) -> None:
    """``masks`` [3, K, T] (zeros): each scored row's prompt, instruction and data positions."""
    for r, i in enumerate(rows.ok):
        spec: ProbeSpec = found[i][2].sampling_params.extra_args[PROBE_ARG]
        masks[0, r, : rows.num_prompt_tokens[i]] = True
        for a, b in spec["instruction"]:
            masks[1, r, a:b] = True
        for a, b in spec["data"]:
            masks[2, r, a:b] = True


def _device_slots(
    table: torch.Tensor, batch: torch.Tensor, width: int, block_size: int
) -> torch.Tensor:
    """[K, width] KV slot of every position of the rows ``batch`` of the device block table."""
    blocks = table.index_select(0, batch)[:, : (width + block_size - 1) // block_size]
    positions = torch.arange(width, device=table.device)
    return blocks.long()[:, positions // block_size] * block_size + positions % block_size


def check_slots(rows: StepRows, slot_mapping: torch.Tensor) -> None:
    """Flag rows whose last prompt token's KV slot, from the block table, is not the slot vLLM
    wrote it to (once per step): the data-mean memo would then be read at the wrong places."""
    if rows.scored:
        assert rows.token_rows is not None and rows.last_slots is not None
        written = slot_mapping.index_select(0, rows.token_rows).long()
        rows.flag(SLOT, written != rows.last_slots)
