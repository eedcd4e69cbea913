"""The engine <-> worker wire format, written once and imported by both sides.

Everything that crosses the process boundary between the caller (``guardrail.engine``) and the
worker extension (``guardrail.worker``) is defined here: the ``SamplingParams.extra_args`` keys a
request carries, the plain-data specs under them, the names of the ``collective_rpc`` methods and
the dicts those methods return. Only plain Python data crosses (vLLM serialises ``extra_args``
with msgspec and RPC results with pickle): lists, not tuples; no tensors.

Example:
    >>> spec: ProbeSpec = {"key": "r1", "instruction": [[0, 4]], "data": [[5, 9]],
    ...                    "num_prompt_tokens": 12}
    >>> sorted(spec)
    ['data', 'instruction', 'key', 'num_prompt_tokens']
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, NotRequired, TypedDict

__all__ = [
    "CAPTURE_ARG",
    "ENGINE_ENV",
    "FAST_EXIT_ENV",
    "MAX_STORED_RESULTS",
    "NOT_GUARDABLE",
    "PROBE_ARG",
    "RPC_CAPTURE_LAYERS",
    "RPC_INSTALL",
    "RPC_LOAD_STEERING",
    "RPC_MODEL_INFO",
    "RPC_POP_RESULTS",
    "RPC_POP_STEERING",
    "RPC_PUSH_RESULTS",
    "RPC_SET_FAULTS",
    "RPC_UNINSTALL",
    "RPC_UNLOAD_STEERING",
    "STEER_ARG",
    "STOP_PROCESSOR",
    "STREAM_MEMOS_KEY",
    "STREAM_OP",
    "STREAM_TAPS_KEY",
    "STREAM_TAP_WORKERS",
    "WORKER_EXTENSION",
    "CaptureSpec",
    "ModelInfo",
    "PoppedResults",
    "ProbeErrorReason",
    "ProbeResultData",
    "ProbeSpec",
    "PushedResults",
    "SteerReportData",
    "SteerSpec",
    "injected_fault_message",
]

# -- where vLLM finds the worker side -----------------------------------------------------------
WORKER_EXTENSION = "guardrail.worker.extension.GuardrailWorkerExtension"
"""``LLM(worker_extension_cls=...)``: mixed into vLLM's worker class in the worker process."""
ENGINE_ENV = "GUARDRAIL_ENGINE"
"""Set to "1" while the caller starts an engine: the processes vLLM spawns inherit it, and the
vLLM plugin ``guardrail.worker.lifecycle`` (entry point in pyproject.toml) acts in them only."""
FAST_EXIT_ENV = "GUARDRAIL_FAST_EXIT"
"""Set to "0" (by the user) to keep vLLM's collection of the heap at exit in a guarded engine's
processes (``guardrail.worker.lifecycle``)."""
STOP_PROCESSOR = "guardrail.worker.stop:ProbeStopLogitsProcessor"
"""``LLM(logits_processors=[...])``: ends probe-stopped requests right after prefill."""
STREAM_OP = "guardrail::read_stream"
"""The custom op a tapped decoder layer calls with its output (``guardrail.worker.stream_op``)."""
STREAM_TAPS_KEY = "guardrail_stream_taps"
"""``LLM(additional_config={STREAM_TAPS_KEY: [layers]})``: the decoder layers whose residual
stream a compiled engine's worker taps at model load (``guardrail.worker.taps``). vLLM hashes
``additional_config`` into its compile-cache key, so a graph with taps never serves an engine
without them, or with others."""
STREAM_MEMOS_KEY = "guardrail_stream_memos"
"""``LLM(additional_config={STREAM_MEMOS_KEY: [read-out, ...]})``: the read-outs over the data
tokens (``HiddenLayerProbe`` as JSON, positions ``data_mean`` and ``data_top``) whose memos a
compiled engine's worker keeps from before vLLM captures its CUDA graphs
(``guardrail.worker.taps.install_memos``)."""
STREAM_TAP_WORKERS = {
    "cpu": "guardrail.worker.cpu_worker.GuardrailCPUWorker",
    "cuda": "guardrail.worker.gpu_worker.GuardrailGPUWorker",
}
"""``LLM(worker_cls=...)`` by device type: the vLLM worker that installs the stream taps before
vLLM compiles the model (and on CUDA splits the compiled graph at them). A device type without
one reads the hidden state in eager mode only."""

# -- SamplingParams.extra_args keys ---------------------------------------------------------------
PROBE_ARG = "guardrail_probe"
"""A probed request's ``ProbeSpec``."""
STEER_ARG = "guardrail_steer"
"""A steered request's ``SteerSpec``."""
CAPTURE_ARG = "guardrail_capture"
"""A request whose last-prompt-token residual stream is captured: a ``CaptureSpec``."""

NOT_GUARDABLE = "guardrail probe refused: "
"""Starts the message of an install the worker refuses (a ``ValueError`` there). vLLM's engine
core hands a worker's exception to the caller as a plain ``Exception`` carrying its message
only, so the caller recognises a refusal by this text and raises ``EngineNotGuardableError``."""

MAX_STORED_RESULTS = 65536
"""Results and reports wait in the worker until popped; past this many the oldest are dropped."""

# -- collective_rpc method names (methods of GuardrailWorkerExtension) --------------------------
RPC_MODEL_INFO = "guardrail_model_info"  # () -> ModelInfo
RPC_INSTALL = "guardrail_install"  # (heads: [[layer, head]], config: dict, raw_hidden_layers:
# [layer], raw_data_mean_layers: [layer]) -> ModelInfo
RPC_UNINSTALL = "guardrail_uninstall"  # () -> None
RPC_POP_RESULTS = "guardrail_pop_results"  # (keys: [str]) -> PoppedResults
RPC_PUSH_RESULTS = "guardrail_push_results"  # (address: str | None, hello: str) -> bool
RPC_SET_FAULTS = "guardrail_set_faults"  # (keys: [str]) -> None


def injected_fault_message(layer: int) -> str:
    """The error of a request whose key is among the injected faults (``RPC_SET_FAULTS``): what
    its first hooked ``layer`` would report (reason ``ProbeErrorReason.LAYER``); the worker and
    ``guardrail.testing.FakeEngine`` both write it."""
    return f"layer {layer}: RuntimeError: fault injected for testing"


RPC_LOAD_STEERING = "guardrail_load_steering"  # (name, direction, layer, avg_proj) -> [layer]
RPC_UNLOAD_STEERING = "guardrail_unload_steering"  # (names: [str] | None) -> [layer]
RPC_CAPTURE_LAYERS = "guardrail_capture_layers"  # (layers: [int]) -> [layer]
RPC_POP_STEERING = "guardrail_pop_steering"  # (keys: [str]) -> {key: SteerReportData}


class ProbeSpec(TypedDict):
    """``extra_args[PROBE_ARG]``: what the worker needs to score one request.

    Spans are half-open token ranges on the request's prompt token ids. The ``stop_*`` fields
    are present only when the request may be ended right after its prefill.
    """

    key: str  # the caller's key for this request's result (never vLLM's request id)
    instruction: list[list[int]]
    data: list[list[int]]
    num_prompt_tokens: int
    stop_below: NotRequired[float]  # end the request when its focus is at or below this
    stop_on_error: NotRequired[bool]  # ... or when the probe could not score it
    stop_token: NotRequired[int]  # the token forced as its first (and only) output
    tag: NotRequired[str]  # the caller's call: pushed back with the result (``PushedResults``)
    # calibration: prompt positions whose whole stream, at each layer the engine keeps whole
    # streams of (``raw_data_mean_layers``), comes back in ``ProbeResultData.token_states``
    stream_positions: NotRequired[list[int]]


class SteerSpec(TypedDict):
    """``extra_args[STEER_ARG]``: steer this request with a vector loaded in the worker."""

    key: str
    vector: str
    method: str  # "add_vector" | "adjust_rs"
    coefficient: float


class CaptureSpec(TypedDict):
    """``extra_args[CAPTURE_ARG]``: capture this request's residual stream at the capture
    layers, at its last prompt token."""

    key: str


class ProbeErrorReason(StrEnum):
    """Why the probe could not score a request: the category every probe error carries next to
    its message, written where the error is made. Its values are the ``reason`` label of
    ``guardrail_probe_errors_total`` (docs/metrics.md); the message is for people, and nothing
    parses it.

    Example:
        >>> ProbeErrorReason("layer") is ProbeErrorReason.LAYER, str(ProbeErrorReason.LAYER)
        (True, 'layer')
    """

    PLAN = "plan"  # planning the request's key gather (spans, the KV slot check)
    LAYER = "layer"  # a hooked attention layer failed (also a fault injected for testing)
    PROBE = "probe"  # scoring the step failed (the KV layout check, another rank's failure)
    AGGREGATE = "aggregate"  # combining head scores failed (kept for dashboards; none today)
    MISSING = "missing"  # no score came back for the request
    INCOMPLETE = "incomplete"  # some configured heads or hidden layers were not scored
    HIDDEN = "hidden"  # reading a hidden layer failed, or its logit term is not finite
    ENGINE = "engine"  # the engine died before the request was answered
    OTHER = "other"  # anything else, e.g. a non-finite score


class ProbeResultData(TypedDict):
    """One request's probe result, popped by key (``RPC_POP_RESULTS``), from one rank."""

    num_prompt_tokens: int
    probe_seconds: float
    stats: NotRequired[bytes]  # every head's stats, float64, flat, in ``PoppedResults.heads`` order
    error: NotRequired[str]  # why the probe could not score (the request is then unscored)
    reason: NotRequired[str]  # the error's ``ProbeErrorReason`` value (set with ``error``)
    hidden: NotRequired[list[list[Any]]]  # [[layer, logit term], ...]: the config's hidden part
    hidden_states: NotRequired[list[list[Any]]]  # [[layer, float64 bytes], ...]: raw (calibration)
    data_mean_states: NotRequired[list[list[Any]]]  # the same, averaged over the data tokens
    # [[layer, positions, float32 bytes [positions, hidden]], ...]: ``ProbeSpec.stream_positions``
    token_states: NotRequired[list[list[Any]]]
    focus: NotRequired[float]  # computed in the worker when it decided an early stop
    stopped: NotRequired[bool]  # ended right after prefill
    tag: NotRequired[str]  # the request's ``ProbeSpec.tag``, when it had one


class PoppedResults(TypedDict):
    """One rank's answer to ``RPC_POP_RESULTS``: the heads its results hold, once, in the order
    of each result's ``stats`` (len(ATTENTION_STATS) values per head), and the results by key."""

    heads: list[list[int]]  # [[layer, head], ...]
    results: dict[str, ProbeResultData]
    # keys asked for that the worker's pusher took (``RPC_PUSH_RESULTS``): sent, or being sent,
    # to the caller's socket, so not here; the caller waits for them there
    pushed: NotRequired[list[str]]


class PushedResults(TypedDict):
    """One message a worker pushes to the caller's results socket (``RPC_PUSH_RESULTS``),
    msgpack-encoded: first ``hello`` (the token the caller sent) with the head order of every
    result's ``stats``, then the results of each finished step as soon as they reach the host,
    so the caller has them when the request's first output arrives, with no pop round trip."""

    hello: NotRequired[str]
    heads: NotRequired[list[list[int]]]  # with ``hello``: as ``PoppedResults.heads``
    results: NotRequired[dict[str, ProbeResultData]]


class SteerReportData(TypedDict):
    """One request's steering/capture report (``RPC_POP_STEERING``), from one rank."""

    tokens: int  # positions the steering hook changed
    error: str | None
    residuals: list[list[Any]]  # [[layer, [values...]], ...] captured streams


class ModelInfo(TypedDict):
    """Facts about the served model and engine (``RPC_MODEL_INFO``), validated by the caller."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    attention_layers: int
    backend: str
    isa: str | None
    kv_cache_dtype: str
    block_size: int
    enforce_eager: bool
    compilation_mode: str
    cudagraph_mode: str
    tp_rank: int
    tp_size: int
    pp_size: int
    device: str
    fast_exit: bool  # this worker exits without collecting its heap (guardrail.worker.lifecycle)
    dtype: NotRequired[str]  # the model's compute dtype, e.g. bfloat16
    hooked_layers: NotRequired[list[int]]
    hidden_layers: NotRequired[list[int]]  # decoder layers whose residual stream is read
    probe_kernel: NotRequired[str]  # "triton": fused kernels (one launch a step); "torch"
