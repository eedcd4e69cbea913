"""The hidden-state signal inside vLLM's worker: the residual stream at the last prompt token,
and read-outs over the request's data tokens (their mean, or their highest values).

A forward hook on each decoder layer the config reads (``ModelProbeConfig.hidden``) takes the
layer's output stream (the layer returns ``(hidden, residual)``; the stream is their sum, before
the final norm) and computes the layer's terms of the probe's logit on the device, for the rows
the attention probe scores in this step. For a read-out ``sum(weights * (x[dims] - mean) /
scale)`` that is ``x[dims] @ (weights / scale) - sum(weights * mean / scale)``:

- ``last``: ``x`` is the stream at the last prompt token, which is always computed in the step
  that scores the request (vLLM never serves it from the prefix cache), so cached prefixes and
  chunked prefill change nothing for it.
- ``data_mean``: ``x`` is the mean of the streams of the request's data tokens. The read-out is
  linear, so the mean of the per-token projections ``x_t[dims] @ (weights / scale)`` is enough.
  Data tokens may have been computed in an earlier chunked-prefill step, or by an earlier
  request whose KV blocks this one reuses from the prefix cache (shared documents, earlier
  turns): their streams are never seen again. So the hook writes, in *every* step, each computed
  token's projection into a memo laid out like the paged KV cache, one float per KV slot, at the
  step's ``slot_mapping`` (where the layer's keys and values are written). A slot's memo entry
  is therefore written whenever its KV entry is, and a block served from the prefix cache brings
  its projections along: the read-out gathers them through the request's block table and does
  not depend on the cache state. Cost: one float32 per KV slot per read-out (about 0.7 MB for
  180,000 cached tokens) and a gather-and-dot over the step's tokens. The memo starts as NaN: a
  slot never computed in this process (KV loaded by a connector, or cached before install; the
  clients reset the prefix cache at install) makes the term NaN, recorded as the row's error.
- ``data_top``: the same per-token projections, from their own memo, pooled as the mean of
  the ``top_k`` largest over the data tokens (``DataReadout``): a read-out made for single
  tokens, which a short injection in a long document moves where the mean would dilute it.
  A config's ``data_top`` parts on several layers are one token model: each layer writes its
  projections into its own memo, and the last of them sums the memos per slot before taking
  the ``top_k`` largest; its layer carries the whole term, the others' ``data_top`` add 0.

Layers asked for by calibration keep whole streams: ``raw_last`` returns the last token's, and
a ``raw_memo`` (the whole stream per KV slot, ``hidden_size`` float32 each: calibration engines
only) the data tokens' mean, and the streams at the prompt positions a request asks for
(``ProbeSpec.stream_positions``: what a token-level read-out is fitted on). The hooks share
the attention probe's plan and rows (``guardrail.worker.probe.Probe``), so both signals come
from the same pass and the same rows, and the step's results are stored once.

Python forward hooks added after start run only in eager mode. In compiled mode a layer is read
through its stream tap, a hook vLLM's worker put on it at model load, before compiling, which
calls the ``guardrail::read_stream`` op (``guardrail.worker.taps``,
``guardrail.worker.stream_op``): the same reader as the eager hook, called with the same
tensors. There the worker, not the reader, keeps the data-mean memo (``MemoWriter``), whose
tensor operations CUDA graphs capture, so decode steps replayed as full graphs write it too. A
compiled engine whose layers are not tapped refuses a config with a hidden part
(docs/compiled-hidden.md). With tensor parallelism the stream between layers is the
same on every rank; with pipeline parallelism each stage reads the layers it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from guardrail.probe.config import (
    DATA_POSITIONS,
    HiddenLayerProbe,
    HiddenPosition,
    ModelProbeConfig,
)
from guardrail.protocol import STREAM_MEMOS_KEY, STREAM_TAP_WORKERS, ProbeErrorReason
from guardrail.worker.forward import decoder_layers, step_metadata
from guardrail.worker.rows import StepRows
from guardrail.worker.stream_op import MEMOS, READERS, tapped_layers

__all__ = [
    "DataReadout",
    "HiddenReader",
    "LayerMemos",
    "MemoWriter",
    "Readout",
    "install_hidden",
    "kv_slots",
    "make_hidden_hook",
    "make_hidden_read",
    "new_memo",
    "write_memo",
]


@dataclass
class Readout:
    """One ``HiddenLayerProbe`` folded for the device: ``term = x[dims] @ coef - offset``."""

    dims: torch.Tensor
    coef: torch.Tensor
    offset: torch.Tensor
    whole: bool = False  # dims are 0 .. n-1: the whole stream where it is n wide (token read-out)

    @classmethod
    def of(cls, part: HiddenLayerProbe, device: Any) -> Readout:
        weights = torch.tensor(part.weights, dtype=torch.float64)
        scale = torch.tensor(part.scale, dtype=torch.float64)
        mean = torch.tensor(part.mean, dtype=torch.float64)
        return cls(
            torch.tensor(part.dims, dtype=torch.long, device=device),
            (weights / scale).float().to(device),
            (weights * mean / scale).sum().float().to(device),
            whole=list(part.dims) == list(range(len(part.dims))),
        )

    def project(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """``x[dims] @ coef`` for each row of the stream ``hidden (+ residual)``. A read-out of
        the whole stream uses it as it is: the same values as through the gather (the sum is
        elementwise), without two copies of the step's streams (every token, every step)."""
        if self.whole and hidden.shape[1] == self.dims.shape[0]:
            return _whole_stream(hidden, residual) @ self.coef
        x = hidden.index_select(1, self.dims)
        if residual is not None:
            x = x + residual.index_select(1, self.dims)
        return x.float() @ self.coef


def _whole_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return (hidden if residual is None else hidden + residual).float()


def new_memo(slots: int, device: Any, width: int | None = None) -> torch.Tensor:
    """A memo of ``slots`` KV slots (one float32, or ``width``, each) plus the spare entry
    ``write_memo`` sends padded tokens to; NaN until a slot is written."""
    shape = (slots + 1,) if width is None else (slots + 1, width)
    return torch.full(shape, float("nan"), device=device)


def write_memo(
    memo: torch.Tensor,
    slot_mapping: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    value: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> None:
    """Write ``value(hidden, residual)`` of every token of the step at its KV slot of ``memo``;
    padded tokens (slot -1) go to the spare last entry. Tensor operations only, with no host
    synchronisation: safe to capture in a CUDA graph, which replays it with the step's slots."""
    n = min(slot_mapping.shape[0], hidden.shape[0])
    slots = slot_mapping[:n].long()
    slots = torch.where(slots >= 0, slots, memo.shape[0] - 1)
    memo.index_copy_(0, slots, value(hidden[:n], residual[:n] if residual is not None else None))


@dataclass
class MemoWriter:
    """The data-mean memo of one tapped decoder layer, owned by the worker (not the probe).

    A compiled engine's worker makes it before vLLM captures its CUDA graphs
    (``guardrail.worker.taps.install_memos``), from the read-out the engine was started with,
    and the layer's ``guardrail::read_stream`` op calls it in every step: between the compiled
    pieces (where the op is a splitting op) and inside the full CUDA graphs of decode steps,
    where its tensor operations were captured with vLLM's persistent slot-mapping buffer, so
    they replay with each step's slots. The memo therefore mirrors the KV cache in every step,
    whatever graph runs it, and the probe reads it (``HiddenReader.read``). A write that fails
    poisons the memo (NaN): every data-mean term then fails its row, never a stale mean."""

    readout: Readout
    memo: torch.Tensor  # [slots + 1] float32 (``new_memo``)

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        from vllm.forward_context import get_forward_context

        metadata = step_metadata(get_forward_context())
        if metadata is None:  # profiling, piecewise capture
            return
        try:
            write_memo(self.memo, metadata.slot_mapping, hidden, residual, self.readout.project)
        except Exception:
            self.memo.fill_(float("nan"))

    def matches(self, readout: Readout) -> bool:
        """Whether ``readout`` projects on the same coordinates and coefficients."""
        mine = self.readout
        return torch.equal(mine.dims.cpu(), readout.dims.cpu()) and torch.equal(
            mine.coef.cpu(), readout.coef.cpu()
        )


@dataclass
class LayerMemos:
    """The memos the worker keeps for one tapped decoder layer, one per data position
    (``DATA_POSITIONS``), each written by its own ``MemoWriter``: what the layer's op calls."""

    writers: dict[str, MemoWriter]

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        for writer in self.writers.values():
            writer(hidden, residual)


@dataclass
class DataReadout:
    """A read-out over the request's data tokens and the memo of its per-token values (one
    float32 per KV slot): ``data_mean`` averages them, ``data_top`` the ``top_k`` largest."""

    position: HiddenPosition
    readout: Readout
    memo: torch.Tensor  # [slots + 1] (``new_memo``)
    top_k: int = 1
    # data_top on several layers (one token model): the earlier layers' memos, summed per
    # slot with this one's; ``offset``: the term's offset, theirs included (set once, by
    # ``_join_token_model``); ``summed_elsewhere``: this is one of those earlier read-outs, its
    # values counted in the last layer's term (its own term is 0)
    joined: list[torch.Tensor] = field(default_factory=list)
    summed_elsewhere: bool = False
    offset: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.offset = self.readout.offset

    def term(self, rows: StepRows) -> torch.Tensor:
        """Every scored row's term [K], from the memo through the rows' KV slots (on the
        device): 0 for a row without data; NaN where a data slot was never written."""
        assert rows.data is not None and rows.slots is not None
        count = rows.data.sum(1)  # [K] data tokens per row
        if self.summed_elsewhere:
            return torch.zeros(count.shape, dtype=torch.float32, device=count.device)
        values = self.memo[rows.slots]  # [K, T]
        for memo in self.joined:  # the same tokens' values on the earlier layers
            values = values + memo[rows.slots]
        if self.position == "data_mean":
            pooled = torch.where(rows.data, values, 0.0).sum(1) / count.clamp(min=1)
        else:  # the mean of the k largest (NaN, a never-written slot, sorts above them all)
            k = min(self.top_k, values.shape[1])
            top = torch.where(rows.data, values, float("-inf")).topk(k, dim=1).values
            taken = count.clamp(max=k)
            kept = torch.arange(k, device=top.device) < taken[:, None]
            pooled = torch.where(kept, top, 0.0).sum(1) / taken.clamp(min=1)
        return torch.where(count > 0, pooled - self.offset, 0.0)


@dataclass
class HiddenReader:
    """One decoder layer whose residual stream the probe reads."""

    index: int
    last: Readout | None = None  # the config's read-out at the last prompt token
    data: list[DataReadout] = field(default_factory=list)  # the config's data read-outs
    raw_last: bool = False  # return the last token's whole stream (calibration)
    worker_memo: bool = False  # ``data``'s memos are ``MemoWriter``s': written by the worker's op
    raw_memo: torch.Tensor | None = None  # [slots + 1, hidden_size]: streams (raw_mean_layers)
    handle: Any = None  # RemovableHandle of the forward hook

    @property
    def remembers(self) -> bool:
        return (bool(self.data) and not self.worker_memo) or self.raw_memo is not None

    def remember(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, slot_mapping: torch.Tensor
    ) -> None:
        """Write every computed token's projections (unless the worker's ``MemoWriter``s do)
        and whole stream at its KV slot."""
        if not self.worker_memo:
            for part in self.data:
                write_memo(part.memo, slot_mapping, hidden, residual, part.readout.project)
        if self.raw_memo is not None:
            write_memo(self.raw_memo, slot_mapping, hidden, residual, _whole_stream)

    def read(self, rows: StepRows, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Every scored row's logit term (the sum of this layer's read-outs) and raw streams,
        from the layer's output and the memo: a few gathers for the whole step, on the device."""
        if not rows.scored:
            return
        assert rows.token_rows is not None and rows.data is not None and rows.slots is not None
        term: torch.Tensor | None = None
        if self.last is not None or self.raw_last:
            last = hidden.index_select(0, rows.token_rows)
            if residual is not None:
                last = last + residual.index_select(0, rows.token_rows)
            if self.last is not None:
                term = self.last.project(last, None) - self.last.offset
            if self.raw_last:
                rows.streams[self.index] = last.float()
        for part in self.data:  # no data: the read-out adds nothing; never written: NaN
            pooled = part.term(rows)
            term = pooled if term is None else term + pooled
        if term is not None:
            rows.terms[self.index] = term
        if self.raw_memo is not None:
            denominator = rows.data.sum(1).clamp(min=1)
            streams = torch.where(rows.data[..., None], self.raw_memo[rows.slots], 0.0)
            rows.mean_streams[self.index] = streams.sum(1) / denominator[:, None]
            self.read_positions(rows)

    def read_positions(self, rows: StepRows) -> None:
        """The whole streams at the prompt positions rows asked for (``stream_positions``),
        from the raw memo, copied to the host in one gather and one copy for the step's rows
        (calibration engines only: the copy's synchronisation costs nothing that matters)."""
        assert self.raw_memo is not None and rows.slots is not None
        asked: list[tuple[int, int, list[int]]] = []
        for r, i in enumerate(rows.ok):
            positions = rows.positions[i]
            if positions:
                asked.append((r, i, positions))
        if not asked:
            return
        table_rows = [r for r, _, positions in asked for _ in positions]
        at = [p for _, _, positions in asked for p in positions]
        index = torch.as_tensor([table_rows, at], dtype=torch.long).to(rows.slots.device)
        states = self.raw_memo[rows.slots[index[0], index[1]]].float().cpu()
        by_row = rows.token_states.setdefault(self.index, {})
        parts = states.split([len(positions) for _, _, positions in asked])
        for (_, i, _), part in zip(asked, parts, strict=True):
            by_row[i] = part


def make_hidden_read(probe: Any, reader: HiddenReader, runner: Any) -> Any:
    """The reader of one decoder layer read by the probe: called with the layer's output
    ``(hidden, residual)`` in every step, by the eager forward hook (``make_hidden_hook``) or
    by the compiled graph's ``guardrail::read_stream`` op (``guardrail.worker.stream_op``);
    never raises into the engine."""
    from vllm.forward_context import get_forward_context

    def read(hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        started = time.perf_counter()
        try:
            context = get_forward_context()
            metadata = step_metadata(context)
            if metadata is None:  # warm-up, profiling
                return
            if reader.remembers:  # every step: the memo mirrors the KV cache
                reader.remember(hidden, residual, metadata.slot_mapping)
            if probe.plan(runner, context, metadata):
                reader.read(probe.rows, hidden, residual)
        except Exception as exc:  # recorded for the step's rows
            message = f"hidden layer {reader.index}: {type(exc).__name__}: {exc}"
            probe.rows.fail_all(message, ProbeErrorReason.HIDDEN)
        probe.probe_seconds += time.perf_counter() - started
        if probe.rows and probe.finish_on_hidden and reader.index == probe.last_layer:
            probe.finish_step()

    return read


def make_hidden_hook(probe: Any, reader: HiddenReader, runner: Any) -> Any:
    """The eager forward hook of one decoder layer read by the probe (``make_hidden_read``)."""
    read = make_hidden_read(probe, reader, runner)

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        read(hidden, residual)

    return hook


def _connect(probe: Any, reader: HiddenReader, runner: Any, layer: Any, tapped: bool) -> Any:
    """Have ``reader`` read ``layer``'s output: through the layer's stream tap when it has one
    (installed at model load: ``guardrail.worker.taps``), else through a forward hook. Returns
    the handle that undoes it."""
    if tapped:
        engine = runner.vllm_config.compilation_config.static_forward_context
        return READERS.connect(engine, reader.index, make_hidden_read(probe, reader, runner))
    return layer.register_forward_hook(make_hidden_hook(probe, reader, runner))


def kv_slots(runner: Any) -> int:
    """How many token slots the engine's paged KV cache has (num_blocks x block_size)."""
    config = getattr(runner, "kv_cache_config", None)
    num_blocks = getattr(config, "num_blocks", None)
    if not num_blocks:
        raise ValueError(
            "the data-mean hidden-state read-out needs the KV cache's size, and this runner "
            "has no kv_cache_config.num_blocks; use a 'last'-position config"
        )
    return int(num_blocks) * int(runner.vllm_config.cache_config.block_size)


def install_hidden(
    probe: Any,
    runner: Any,
    info: dict[str, Any],
    config: ModelProbeConfig | None,
    raw_layers: list[int],
    raw_mean_layers: list[int] | None = None,
) -> None:
    """Hook the decoder layers of ``config.hidden``, ``raw_layers`` (the last token's whole
    stream returned) and ``raw_mean_layers`` (the data tokens' mean stream returned) for
    ``probe`` (a ``guardrail.worker.probe.Probe``); its step then finishes after the last of its
    attention layers and these. A layer tapped at model load is read through its tap
    (compiled engines), any other through a forward hook (eager engines)."""
    raw_mean_layers = raw_mean_layers or []
    parts = (config.hidden if config is not None else None) or []
    wanted = sorted({p.layer for p in parts} | set(raw_layers) | set(raw_mean_layers))
    if not wanted:
        return
    layers = decoder_layers(runner)
    if layers is None:
        raise ValueError(
            f"{type(runner.model).__name__} has no model.layers: the hidden-state signal "
            "cannot read this model; use an attention-only config"
        )
    for index in wanted:
        if not 0 <= index < len(layers):
            raise ValueError(f"hidden layer {index} outside the model's {len(layers)} layers")
    # With pipeline parallelism a stage holds some layers only (the others are placeholders).
    held = [i for i in wanted if type(layers[i]).__name__ != "PPMissingLayer"]
    tapped = tapped_layers(layers)
    _check_compiled(info, held, tapped)
    for part in parts:
        if max(part.dims) >= info["hidden_size"]:
            raise ValueError(
                f"hidden layer {part.layer} reads coordinate {max(part.dims)}, outside the "
                f"model's hidden size {info['hidden_size']}"
            )
    needs_memo = raw_mean_layers or any(p.position in DATA_POSITIONS for p in parts)
    if needs_memo and getattr(runner.vllm_config, "kv_transfer_config", None) is not None:
        raise ValueError(
            "the data-mean hidden-state read-out cannot run with a KV connector: KV blocks "
            "loaded from elsewhere bring no residual streams; use a 'last'-position config"
        )
    slots = kv_slots(runner) if needs_memo else 0
    device = runner.device
    _check_raw_memo_fits(len(raw_mean_layers), slots, info, device, runner)
    for index in held:
        reader = HiddenReader(index, raw_last=index in raw_layers)
        reader.worker_memo = index in tapped  # the worker writes them, also in captured graphs
        for part in parts:
            if part.layer == index and part.position == "last":
                reader.last = Readout.of(part, device)
            elif part.layer == index:
                readout = Readout.of(part, device)
                memo = (
                    _worker_memo(runner, readout, index, part.position)
                    if reader.worker_memo
                    else new_memo(slots, device)
                )
                reader.data.append(DataReadout(part.position, readout, memo, part.top_k or 1))
        if index in raw_mean_layers:
            reader.raw_memo = new_memo(slots, device, info["hidden_size"])
        reader.handle = _connect(probe, reader, runner, layers[index], index in tapped)
        probe.hidden[index] = reader
    _join_token_model(parts, held, [probe.hidden[i] for i in held])
    probe.needs_data_slots = any(r.remembers for r in probe.hidden.values())
    if probe.hidden and max(probe.hidden) >= probe.last_layer:
        probe.last_layer, probe.finish_on_hidden = max(probe.hidden), True


def _join_token_model(
    parts: list[HiddenLayerProbe], held: list[int], readers: list[HiddenReader]
) -> None:
    """Make a config's ``data_top`` read-outs on several layers one token model: the last of
    them sums the others' memos per slot before taking the highest (module doc)."""
    top_layers = sorted(p.layer for p in parts if p.position == "data_top")
    on_stage = set(top_layers) & set(held)
    if len(top_layers) < 2 or not on_stage:
        return
    if on_stage != set(top_layers):
        raise ValueError(
            f"the token read-out (data_top) reads layers {top_layers} together, and this "
            f"pipeline stage holds only {sorted(on_stage)}: serve it "
            "without pipeline parallelism, or with its layers on one stage"
        )
    tops = [d for r in sorted(readers, key=lambda r: r.index) for d in r.data]
    tops = [d for d in tops if d.position == "data_top"]
    *earlier, last = tops
    last.joined = [readout.memo for readout in earlier]
    for readout in earlier:
        last.offset = last.offset + readout.readout.offset
        readout.summed_elsewhere = True


def _worker_memo(runner: Any, readout: Readout, layer: int, position: str) -> torch.Tensor:
    """The memo the worker keeps for ``position`` of tapped ``layer`` (``MemoWriter``),
    checked against the probe's read-out: a compiled engine's data read-outs are fixed when it
    starts."""
    engine = runner.vllm_config.compilation_config.static_forward_context
    memos = MEMOS.reader(engine, layer)
    writer = memos.writers.get(position) if isinstance(memos, LayerMemos) else None
    if writer is None or not writer.matches(readout):
        what = f"no {position} memo" if writer is None else f"another {position} read-out"
        raise ValueError(
            f"hidden layer {layer}: this compiled engine's worker keeps {what} for it; a "
            "compiled engine's data read-outs are fixed at start (additional_config "
            f"{STREAM_MEMOS_KEY!r}): start the engine with this config, or with "
            "enforce_eager=True"
        )
    return writer.memo


def _check_compiled(info: dict[str, Any], wanted: list[int], tapped: set[int]) -> None:
    """In compiled mode a layer can only be read through a tap installed before compilation:
    refuse, naming what would work, when one is missing."""
    missing = sorted(set(wanted) - tapped)
    if info["enforce_eager"] or not missing:
        return
    where = (
        "a compiled engine reads only the layers its worker tapped at model load "
        "(HookedLLM and AsyncHookedLLM have vLLM tap those of their config and calibration "
        "layers)"
        if str(info["device"]).split(":")[0] in STREAM_TAP_WORKERS
        else f"compiled engines on {info['device']} cannot tap decoder layers "
        "(docs/compiled-hidden.md)"
    )
    raise ValueError(
        f"the hidden-state signal reads decoder layers {missing}, which are not tapped: in "
        "compiled mode the decoder layers run inside a compiled graph where hooks added after "
        f"start never fire, and {where}. Start the engine with enforce_eager=True, or use an "
        "attention-only config"
    )


MEMO_SHARE = 0.8
"""At most this share of the device's free memory goes to the raw data-mean memos."""


def _check_raw_memo_fits(
    layers: int, slots: int, info: dict[str, Any], device: Any, runner: Any
) -> None:
    """Refuse, with the engine argument that fixes it, raw data-mean memos (calibration: the
    whole stream per KV slot and layer) that would not fit the device's free memory: on a GPU
    vLLM gives the KV cache most of the memory, and these memos are larger per token."""
    if not layers or torch.device(device).type != "cuda":
        return
    per_slot = layers * info["hidden_size"] * 4
    free, _ = torch.cuda.mem_get_info(device)
    if (slots + 1) * per_slot <= MEMO_SHARE * free:
        return
    block = int(runner.vllm_config.cache_config.block_size)
    fits = max(int(MEMO_SHARE * free) // per_slot // block, 0)
    raise ValueError(
        f"the data-mean read-outs of {layers} layers need {(slots + 1) * per_slot / 2**30:.1f} "
        f"GiB (hidden_size float32 for each of the KV cache's {slots} slots), and "
        f"{free / 2**30:.1f} GiB is free: start the engine with a smaller KV cache, e.g. "
        f"num_gpu_blocks_override={fits} (guardrail calibrate: --engine-arg "
        f"num_gpu_blocks_override={fits}), or read fewer data-mean layers"
    )
