"""The stream taps of compiled engines, without an engine: the reader registry, the
``guardrail::read_stream`` op (eager and traced by torch.compile), tapping a model's decoder
layers at load, the worker's refusal of untapped layers, the engine arguments that ask for the
taps, and a missing hidden term failing its row."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.forward_context import override_forward_context

from guardrail.engine import install
from guardrail.errors import ConfigError
from guardrail.probe.config import DATA_POSITIONS, HiddenLayerProbe, ModelProbeConfig
from guardrail.protocol import (
    STREAM_MEMOS_KEY,
    STREAM_OP,
    STREAM_TAP_WORKERS,
    STREAM_TAPS_KEY,
    ProbeErrorReason,
)
from guardrail.worker.hidden import (
    DataReadout,
    HiddenReader,
    LayerMemos,
    Readout,
    _check_compiled,
    _join_token_model,
    _worker_memo,
)
from guardrail.worker.probe import Probe, ProbeSettings
from guardrail.worker.rows import FLAG_MESSAGES, NONFINITE, StepRows
from guardrail.worker.stream_op import MEMOS, READERS, StreamReaders, make_tap, tapped_layers
from guardrail.worker.taps import (
    install_memos,
    install_taps,
    memo_readouts,
    split_at_stream_op,
    tap_layers,
)
from tests.helpers import tiny_hidden_config


def step_of(engine: dict[str, Any]) -> Any:
    """A forward context as the op sees it: the engine's ``static_forward_context``."""
    return override_forward_context(SimpleNamespace(no_compile_layers=engine))  # type: ignore[arg-type]


# -- the registry and the op ---------------------------------------------------------------------


def test_readers_are_kept_per_engine_and_layer_and_removed_by_their_handle() -> None:
    readers = StreamReaders()
    a, b = {}, {}
    first, second = (lambda h, r: None), (lambda h, r: None)
    handle = readers.connect(a, 1, first)
    readers.connect(b, 1, second)
    assert readers.reader(a, 1) is first and readers.reader(b, 1) is second
    assert readers.reader(a, 2) is None and readers.reader({}, 1) is None
    handle.remove()
    handle.remove()  # idempotent
    assert readers.reader(a, 1) is None and readers.reader(b, 1) is second
    assert len(readers) == 1


def test_the_op_calls_the_reader_of_the_running_engine_only() -> None:
    mine, other = {}, {}
    seen: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
    handles = [
        READERS.connect(mine, 3, lambda h, r: seen.append(("mine", h, r))),
        READERS.connect(other, 3, lambda h, r: seen.append(("other", h, r))),
    ]
    hidden, residual = torch.randn(5, 8), torch.randn(5, 8)
    try:
        torch.ops.guardrail.read_stream(hidden, residual, 3)  # no step running: nothing
        assert seen == []
        with step_of(mine):
            torch.ops.guardrail.read_stream(hidden, residual, 3)
            torch.ops.guardrail.read_stream(hidden, None, 2)  # no reader on layer 2
        assert [(who, h is hidden, r is residual) for who, h, r in seen] == [("mine", True, True)]
    finally:
        for handle in handles:
            handle.remove()
    with step_of(mine):  # disconnected: nothing
        torch.ops.guardrail.read_stream(hidden, residual, 3)
    assert len(seen) == 1


class Layer(torch.nn.Module):
    """A decoder layer's shape of output: ``(hidden, residual)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), residual + x


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for layer in self.layers:
            x, residual = layer(x, residual)
            x = torch.relu(x)
        return x + residual


def test_a_tap_traced_by_torch_compile_calls_the_reader_with_the_layers_output() -> None:
    """The tap is on the layer before compilation: the compiled graph keeps the op (nothing uses
    its result) and calls it with the same stream the eager model computes."""
    torch.manual_seed(0)
    model = Tiny().eval()
    model.layers[1].register_forward_hook(make_tap(1))
    assert tapped_layers(model.layers) == {1}
    eager_out: dict[str, torch.Tensor] = {}
    model.layers[1].register_forward_hook(
        lambda m, a, out: eager_out.update(stream=(out[0] + out[1]).detach().clone())
    )
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    engine: dict[str, Any] = {}
    got: list[torch.Tensor] = []
    handle = READERS.connect(engine, 1, lambda h, r: got.append((h + r).clone()))
    x = torch.randn(4, 8)
    try:
        with torch.no_grad():
            compiled(x)  # compiles; no step: the op does nothing
            assert got == []
            with step_of(engine):
                compiled(x)
            model(x)  # eager, for the reference
    finally:
        handle.remove()
    assert len(got) == 1
    torch.testing.assert_close(got[0], eager_out["stream"], rtol=0, atol=0)


def test_install_taps_taps_the_layers_in_additional_config() -> None:
    model = Tiny()
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config={STREAM_TAPS_KEY: [2, 0, 2]}),
        model=SimpleNamespace(model=model),
    )
    assert tap_layers(runner.vllm_config) == [0, 2]
    assert install_taps(runner) == [0, 2]
    assert tapped_layers(model.layers) == {0, 2}
    runner.vllm_config.additional_config = {STREAM_TAPS_KEY: [5]}
    with pytest.raises(ValueError, match=r"decoder layers \[5\]"):
        install_taps(runner)
    runner.vllm_config.additional_config = {}
    assert install_taps(runner) == []


def test_the_workers_are_vllms_own_plus_the_taps() -> None:
    from guardrail.worker.cpu_worker import GuardrailCPUWorker
    from guardrail.worker.gpu_worker import GuardrailGPUWorker

    assert GuardrailCPUWorker.__mro__[1].__name__ == "CPUWorker"
    assert GuardrailGPUWorker.__mro__[1].__name__ == "Worker"
    for worker in (GuardrailCPUWorker, GuardrailGPUWorker):
        assert {"load_model", "compile_or_warm_up_model"} <= set(vars(worker))


def test_the_op_joins_the_splitting_ops_vllm_settled_on() -> None:
    attention = ["vllm::unified_attention_with_output", "vllm::unified_kv_cache_update"]
    config = SimpleNamespace(
        additional_config={STREAM_TAPS_KEY: [1]},
        compilation_config=SimpleNamespace(splitting_ops=list(attention)),
    )
    assert split_at_stream_op(config)
    assert config.compilation_config.splitting_ops == [*attention, STREAM_OP]
    assert not split_at_stream_op(config)  # once
    none = SimpleNamespace(
        additional_config={}, compilation_config=SimpleNamespace(splitting_ops=[])
    )
    assert not split_at_stream_op(none)  # no taps, or no piecewise split: unchanged
    assert none.compilation_config.splitting_ops == []


class Runner(SimpleNamespace):
    """A model runner's attributes (a subclass: weakly referable, as vLLM's runner is)."""


def memo_runner(spec: list[dict[str, Any]], layers: int = 4, blocks: int = 3) -> Any:
    model = Tiny()
    model.layers.extend(Layer() for _ in range(layers - 3))
    for i in range(layers):
        model.layers[i].register_forward_hook(make_tap(i))
    return Runner(
        vllm_config=SimpleNamespace(
            additional_config={STREAM_TAPS_KEY: list(range(layers)), STREAM_MEMOS_KEY: spec},
            cache_config=SimpleNamespace(block_size=4),
            compilation_config=SimpleNamespace(static_forward_context={}),
        ),
        model=SimpleNamespace(model=model),
        kv_cache_config=SimpleNamespace(num_blocks=blocks),
        device="cpu",
    )


def test_the_worker_keeps_each_data_memo_and_the_op_writes_it_in_every_step() -> None:
    """The memos a compiled engine's worker makes before graph capture, one per data read-out
    of a layer: one float per KV slot plus the spare, NaN until written; the op writes each
    token's projection at its slot (padded tokens, slot -1, to the spare) and the probe's
    reader finds each by position, same read-out only."""
    part = HiddenLayerProbe(
        layer=2,
        dims=[1, 5],
        mean=[0.0, 1.0],
        scale=[2.0, 4.0],
        weights=[1.0, -2.0],
        position="data_mean",
    )
    top = HiddenLayerProbe(
        layer=2, dims=[3], mean=[0.0], scale=[2.0], weights=[1.0], position="data_top", top_k=2
    )
    runner = memo_runner([part.model_dump(mode="json"), top.model_dump(mode="json")])
    assert memo_readouts(runner.vllm_config) == {2: [part, top]}
    assert install_memos(runner) == [2]
    engine = runner.vllm_config.compilation_config.static_forward_context
    memos = MEMOS.reader(engine, 2)
    try:
        assert isinstance(memos, LayerMemos) and sorted(memos.writers) == ["data_mean", "data_top"]
        writer, top_writer = memos.writers["data_mean"], memos.writers["data_top"]
        assert writer.memo.shape == (13,) and torch.isnan(writer.memo).all()
        hidden, residual = torch.randn(4, 8), torch.randn(4, 8)
        slots = torch.tensor([7, 0, -1, 11])
        metadata = SimpleNamespace(slot_mapping=slots)
        context = SimpleNamespace(no_compile_layers=engine, attn_metadata={"l": metadata})
        with override_forward_context(context):  # type: ignore[arg-type]
            torch.ops.guardrail.read_stream(hidden, residual, 2)
        x = hidden + residual
        want = x[:, 1] * 0.5 + x[:, 5] * -0.5
        torch.testing.assert_close(writer.memo[[7, 0, 12, 11]], want)
        torch.testing.assert_close(top_writer.memo[[7, 0, 12, 11]], x[:, 3] * 0.5)
        assert int(torch.isnan(writer.memo).sum()) == 13 - 4
        assert writer.matches(Readout.of(part, "cpu"))
        other = part.model_copy(update={"weights": [1.0, -1.0]})
        assert not writer.matches(Readout.of(other, "cpu"))
        mean = Readout.of(part, "cpu")
        probe_runner = SimpleNamespace(vllm_config=runner.vllm_config)
        assert _worker_memo(probe_runner, mean, 2, "data_mean") is writer.memo
        assert _worker_memo(probe_runner, Readout.of(top, "cpu"), 2, "data_top") is top_writer.memo
        with pytest.raises(ValueError, match=r"another data_mean read-out.*enforce_eager"):
            _worker_memo(probe_runner, Readout.of(other, "cpu"), 2, "data_mean")
        with pytest.raises(ValueError, match="another data_top read-out"):
            _worker_memo(probe_runner, mean, 2, "data_top")  # the mean's read-out, not the top's
        with pytest.raises(ValueError, match="no data_mean memo"):
            _worker_memo(probe_runner, mean, 3, "data_mean")
        bad = SimpleNamespace(slot_mapping=torch.tensor([0, 1, 2, 99]))  # outside the memo
        with override_forward_context(SimpleNamespace(no_compile_layers=engine, attn_metadata=bad)):  # type: ignore[arg-type]
            torch.ops.guardrail.read_stream(hidden, residual, 2)
        assert torch.isnan(writer.memo).all()  # poisoned: every data term fails its row
        assert torch.isnan(top_writer.memo).all()
        del runner, probe_runner, memos, writer, top_writer
        gc.collect()
        assert MEMOS.reader(engine, 2) is None  # the memo goes with its engine's runner
    finally:
        MEMOS.disconnect(engine, 2)


def test_install_memos_refuses_what_it_cannot_keep() -> None:
    part = HiddenLayerProbe(
        layer=5, dims=[1], mean=[0.0], scale=[1.0], weights=[1.0], position="data_mean"
    )
    with pytest.raises(ValueError, match=r"layers \[5\], which are not tapped"):
        install_memos(memo_runner([part.model_dump(mode="json")]))
    runner = memo_runner([part.model_copy(update={"layer": 1}).model_dump(mode="json")])
    runner.kv_cache_config = None
    with pytest.raises(ValueError, match="KV cache's size"):
        install_memos(runner)
    assert install_memos(memo_runner([])) == []


# -- the worker's refusal, the engine's arguments --------------------------------------------


def test_an_untapped_layer_is_refused_in_compiled_mode_with_what_to_do() -> None:
    eager = {"enforce_eager": True, "device": "cpu"}
    _check_compiled(eager, [1, 2], set())  # eager: forward hooks read it
    _check_compiled({**eager, "enforce_eager": False}, [1, 2], {1, 2})
    with pytest.raises(ValueError, match=r"\[2\], which are not tapped.*HookedLLM"):
        _check_compiled({**eager, "enforce_eager": False}, [1, 2], {1})
    with pytest.raises(ValueError, match=r"\[1\], which are not tapped.*HookedLLM"):
        _check_compiled({"enforce_eager": False, "device": "cuda:0"}, [1], set())
    other = {"enforce_eager": False, "device": "xpu:0"}
    with pytest.raises(ValueError, match=r"on xpu:0 cannot tap.*enforce_eager=True"):
        _check_compiled(other, [1], set())


@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu"])
def test_stream_tap_arguments_ask_for_the_tapping_worker_only_where_it_exists(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(install, "_device_type", lambda: device)
    hidden = tiny_hidden_config()
    plain = ModelProbeConfig(model_id="m", heads=[(0, 1)])
    compiled = {"enforce_eager": False, "additional_config": {"user": 1}}
    got = install.stream_tap_arguments(compiled, hidden, [0])
    tapping = device in STREAM_TAP_WORKERS
    if tapping:
        assert got["worker_cls"] == STREAM_TAP_WORKERS[device]
        memos = got["additional_config"].pop(STREAM_MEMOS_KEY)
        assert got["additional_config"] == {"user": 1, STREAM_TAPS_KEY: [0, 1, 2, 3]}
        data = [p for p in hidden.hidden or [] if p.position in DATA_POSITIONS]
        assert memos == [p.model_dump(mode="json") for p in data]
        assert [(p["layer"], p["position"]) for p in memos] == [
            (1, "data_top"),
            (2, "data_mean"),
            (3, "data_mean"),
            (3, "data_top"),
        ]
        assert compiled == {"enforce_eager": False, "additional_config": {"user": 1}}  # a copy
        with pytest.raises(ConfigError, match="worker_cls"):
            install.stream_tap_arguments({**compiled, "worker_cls": "my.Worker"}, hidden)
    else:  # no tapping worker: the worker refuses the hidden config at install
        assert got == compiled
    assert install.stream_tap_arguments({"enforce_eager": True}, hidden) == {"enforce_eager": True}
    assert install.stream_tap_arguments(compiled, plain) == compiled
    assert install.stream_tap_arguments(compiled, plain, [1])["additional_config"] == (
        {"user": 1, STREAM_TAPS_KEY: [1]} if tapping else {"user": 1}
    )


# -- a term that never came fails its row ----------------------------------------------------


def finished(terms: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Two scored rows through the probe's end of step, with the given per-layer terms of a
    config whose term layers are 1 and 2; the popped results by key."""
    probe = Probe([(0, 0)], set(), ProbeSettings(block_size=32), None)
    probe.term_layers = probe.store.term_layers = [1, 2]
    n = 2
    probe.rows = StepRows(
        keys=["a", "b"],
        num_prompt_tokens=[4, 5],
        errors=[None] * n,
        reasons=[None] * n,
        stop_below=[None] * n,
        stop_on_error=[True] * n,
        stop_token=[None] * n,
        has_data=[True] * n,
        ok=[0, 1],
        valid=torch.ones(n, 5, dtype=torch.bool),
        instruction=torch.ones(n, 5, dtype=torch.bool),
        data=torch.zeros(n, 5, dtype=torch.bool),
        stats=torch.full((n, 1, 5), 0.25),
        flags=torch.zeros(n, len(FLAG_MESSAGES), dtype=torch.bool),
        terms=terms,
    )
    probe.finish_step()
    return probe.pop(["a", "b"])


def test_a_missing_hidden_term_fails_the_row_never_drops_the_term() -> None:
    both = finished({1: torch.tensor([0.5, -1.0]), 2: torch.tensor([0.25, 2.0])})
    assert both["b"]["hidden"] == [[1, -1.0], [2, 2.0]] and "error" not in both["b"]
    one = finished({1: torch.tensor([0.5, -1.0])})  # layer 2's read-out never ran
    for key in ("a", "b"):
        assert one[key]["error"] == FLAG_MESSAGES[NONFINITE]
        assert one[key]["reason"] == ProbeErrorReason.HIDDEN.value
        assert "hidden" not in one[key] and "stats" not in one[key]


def test_a_data_top_term_is_the_mean_of_the_k_highest_data_values() -> None:
    """``DataReadout.term``: over each row's data tokens only, the k highest values' mean
    (all of them when fewer), minus the read-out's offset; 0 without data; a never-written
    slot (NaN) makes the term NaN, so the row fails closed."""
    part = HiddenLayerProbe(
        layer=0, dims=[0], mean=[1.0], scale=[1.0], weights=[1.0], position="data_top", top_k=2
    )
    memo = torch.tensor([5.0, 1.0, 9.0, 3.0, 7.0, float("nan"), 0.0])
    top = DataReadout("data_top", Readout.of(part, "cpu"), memo, top_k=2)
    mean = DataReadout("data_mean", Readout.of(part, "cpu"), memo)
    rows = SimpleNamespace(
        slots=torch.tensor([[0, 1, 2, 3], [4, 1, 0, 0], [0, 1, 2, 3], [5, 4, 0, 0]]),
        data=torch.tensor(
            [
                [False, True, True, True],  # values 1, 9, 3: top two 9 and 3
                [True, False, False, False],  # one data token: 7
                [False, False, False, False],  # no data
                [True, True, False, False],  # a never-written slot among the data
            ]
        ),
    )
    got = top.term(rows)  # type: ignore[arg-type]
    torch.testing.assert_close(got[:3], torch.tensor([6.0 - 1.0, 7.0 - 1.0, 0.0]))
    assert torch.isnan(got[3])
    got_mean = mean.term(rows)  # type: ignore[arg-type]
    torch.testing.assert_close(got_mean[:3], torch.tensor([13 / 3 - 1.0, 6.0, 0.0]))
    assert torch.isnan(got_mean[3])


def test_a_token_model_over_two_layers_sums_their_values_per_token_before_the_top() -> None:
    """``data_top`` on two layers is one token model: the last layer's term is the mean of
    the k highest per-slot *sums* of both memos, minus both offsets; the earlier layer's own
    term is 0 (its values are counted once, in the last layer's)."""
    first = HiddenLayerProbe(
        layer=1, dims=[0], mean=[0.5], scale=[1.0], weights=[1.0], position="data_top", top_k=2
    )
    second = first.model_copy(update={"layer": 3, "mean": [0.25]})
    one = DataReadout("data_top", Readout.of(first, "cpu"), torch.tensor([5.0, 1.0, 9.0, 0.0]), 2)
    two = DataReadout("data_top", Readout.of(second, "cpu"), torch.tensor([0.0, 9.0, 1.0, 0.0]), 2)
    readers = [HiddenReader(3, data=[two]), HiddenReader(1, data=[one])]
    _join_token_model([first, second], [1, 3], readers)
    rows = SimpleNamespace(
        slots=torch.tensor([[0, 1, 2], [0, 1, 2]]),
        data=torch.tensor([[True, True, True], [True, False, False]]),
    )
    # sums 5, 10, 10: the top two 10 and 10 (each layer alone would take 9 and 5, 9 and 1)
    torch.testing.assert_close(two.term(rows), torch.tensor([10.0 - 0.75, 5.0 - 0.75]))  # type: ignore[arg-type]
    torch.testing.assert_close(one.term(rows), torch.zeros(2))  # type: ignore[arg-type]
    config = tiny_hidden_config().model_copy(update={"hidden": [first, second]})
    streams = {1: np.array([[5.0], [1.0], [9.0]]), 3: np.array([[0.0], [9.0], [1.0]])}
    assert config.data_top_term(streams) == pytest.approx(10.0 - 0.75)  # the reference agrees
    with pytest.raises(ValueError, match=r"reads layers \[1, 3\] together.*holds only \[3\]"):
        _join_token_model([first, second], [3], [HiddenReader(3, data=[two])])
    _join_token_model([first, second], [0, 2], [])  # a pipeline stage holding neither: nothing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_whole_stream_read_out_projects_the_values_the_gather_gives(dtype: torch.dtype) -> None:
    """A read-out of every coordinate in order (the token read-out's) uses the stream as it
    is, with no gather: bit for bit the values of ``x[dims]`` taken one coordinate at a time,
    with and without the residual; the first coordinates only, or all of them reordered, are
    gathered."""
    generator = torch.Generator().manual_seed(0)
    hidden, residual = (torch.randn(37, 24, generator=generator).to(dtype) for _ in range(2))
    rng = np.random.default_rng(0)

    def part(dims: list[int]) -> HiddenLayerProbe:
        n = len(dims)
        return HiddenLayerProbe(
            layer=0,
            dims=dims,
            mean=rng.normal(size=n).tolist(),
            scale=rng.uniform(0.5, 2.0, size=n).tolist(),
            weights=rng.normal(size=n).tolist(),
            position="data_top",
            top_k=3,
        )

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, a: Any = (), kw: Any = None) -> Any:
            self.names.append(func.overloadpacket.__name__)
            return func(*a, **(kw or {}))

    whole = Readout.of(part(list(range(24))), "cpu")
    for res in (residual, None):
        x = hidden if res is None else hidden + res  # the reference: one coordinate at a time
        columns = [x[:, d].float() for d in range(24)]
        reference = torch.stack(columns, dim=1) @ whole.coef
        with Ops() as ops:
            got = whole.project(hidden, res)
        assert torch.equal(got, reference)
        assert "index_select" not in ops.names
    for dims in (list(range(12)), [1, 0, *range(2, 24)]):
        readout = Readout.of(part(dims), "cpu")
        x = (hidden + residual)[:, dims].float()
        assert torch.equal(readout.project(hidden, residual), x @ readout.coef)
