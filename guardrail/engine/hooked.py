"""``HookedLLM``: a vLLM engine whose Attention Tracker probe runs inside the real generation.

One pass: the probe reads attention during the prefill of the request's own generation (no
extra probe pass), computes per-head focus scores inside the worker on the model's device, and
returns a few numbers per request. The caller-side work here is rendering prompts into token
spans, attaching each request's probe spec (``ProbeClient``), and matching results back by the
key it carries. Steering is a component (``SteeringClient``) this engine holds.

Example:
    >>> with HookedLLM() as llm:  # doctest: +SKIP
    ...     out = llm.generate([("Summarize the email.", "Hi, lunch at noon?")])[0]
    ...     print(out.probe.focus, out.text)
"""

from __future__ import annotations

import contextlib
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from guardrail.embedded import model_or_embedded
from guardrail.engine.client import PerRequestArgs, per_request_args, request_count
from guardrail.engine.engine_process import EngineHandle, abort_unfinished
from guardrail.engine.hooked_base import HookedBase, refused_as_not_guardable
from guardrail.engine.inbox import (
    IN_TRANSIT_WAIT_S,
    PUSH_WAIT_S,
    ResultInbox,
    in_transit,
    no_push_args,
    pushed,
)
from guardrail.engine.install import (
    SELF_TEST_REQUEST,
    check_self_test,
    check_sizes_from_files,
    engine_arguments,
    engine_probe_config,
    stream_tap_arguments,
)
from guardrail.engine.steering import ResolvedSteering, SteeringClient
from guardrail.engine.types import (
    GuardedOutput,
    ProbeResult,
    logprobs_of,
    per_request,
)
from guardrail.errors import ConfigError, EngineNotGuardableError, GuardrailError, RequestError
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.prompts import PreparedPrompt, RequestLike, prepare_prompt, prepare_prompts
from guardrail.probe.scoring import HeadKey
from guardrail.protocol import (
    RPC_INSTALL,
    RPC_MODEL_INFO,
    RPC_POP_RESULTS,
    RPC_PUSH_RESULTS,
    RPC_SET_FAULTS,
    STEER_ARG,
    ModelInfo,
    PoppedResults,
)
from guardrail.steering import SteeringVector
from guardrail.steering.spec import Steering, SteeringLike

__all__ = ["GuardedOutput", "HookedLLM", "ProbeResult", "per_request"]


FINALIZE_LOCK_WAIT_S = 30.0
"""At garbage collection or interpreter exit, how long closing waits for a running call."""


class HookedLLM(HookedBase):
    """A ``vllm.LLM`` with the guardrail probe installed in its workers (a ``GuardEngine``).

    ``model`` is a model path or id (default: the embedded SmolLM2-135M-Instruct);
    ``probe_config`` a ``ModelProbeConfig``, a JSON path, or None to use the shipped config for
    the model; ``probe_heads`` overrides which heads are scored ("all" scores every head of
    every layer, for calibration); ``probe_hidden_layers`` names decoder layers whose whole
    residual stream at the last prompt token each result carries (``ProbeResult.hidden_states``,
    for calibration; compiled CPU and CUDA engines read it through stream taps, like a config's
    hidden-state part: docs/compiled-hidden.md), and
    ``probe_data_mean_layers`` those whose stream averaged over the data tokens it carries
    (``ProbeResult.data_mean_states``; costs ``hidden_size`` float32 per KV slot per layer; in
    a compiled CUDA engine it is written in piecewise steps only, so it covers prompt tokens,
    not decoded ones).
    Other keyword arguments go to ``vllm.LLM`` unchanged.
    Steering (``load_steering_vector``, ``generate(steering=...)``) needs ``enforce_eager=True``.

    Threads: one engine runs one call at a time. Calls from several threads are serialised by
    a per-engine lock (a second caller waits for the first call to finish), and that covers
    everything that talks to the engine: ``generate``, ``score``, steering and capture,
    ``set_probe_faults`` and ``close``. To batch many callers, send them through
    ``guardrail.guard.batcher.batcher_for``. ``llm`` is the raw ``vllm.LLM``: calls made on it
    directly are not serialised.

    Failures: if an engine process dies, the running call and every later one raise
    ``EngineDeadError`` within about a second; a closed engine raises ``EngineClosedError``.
    ``close()`` is idempotent, runs on its own for engines nobody closed (when collected, or at
    interpreter exit), and leaves no engine process or shared memory behind.
    """

    render_group: int = 8
    """``generate`` renders and enqueues its requests this many at a time (one batched
    tokenizer call each): the engine starts on the first group while the rest are rendered.
    An instance may set its own (``benchmarks/profile_phases.py`` compares)."""

    def __init__(
        self,
        model: str | Path | None = None,
        probe_config: ModelProbeConfig | str | Path | None = None,
        *,
        probe_heads: Sequence[HeadKey] | str | None = None,
        probe_hidden_layers: Sequence[int] = (),
        probe_data_mean_layers: Sequence[int] = (),
        **engine_kwargs: Any,
    ) -> None:
        arguments = engine_arguments(engine_kwargs)
        model = model_or_embedded(model)
        self.model = str(model)
        # with probe_heads it scores heads for calibration: no guard's config to warn about
        self.config = engine_probe_config(
            self.model, probe_config, arguments, announce=probe_heads is None
        )
        check_sizes_from_files(self.model, self.config)
        from vllm import LLM

        self._handle = EngineHandle()
        self._finalizer = weakref.finalize(self, self._handle.close, FINALIZE_LOCK_WAIT_S)
        with EngineHandle.spawning():
            start = EngineHandle.start_arguments(arguments)
            raw_layers = [*probe_hidden_layers, *probe_data_mean_layers]
            llm = LLM(model=self.model, **stream_tap_arguments(start, self.config, raw_layers))
        self._handle.llm = llm
        try:  # from here on, any failure or Ctrl-C closes the engine before propagating
            self._handle.watch()
            self._tokenizer = llm.get_tokenizer()
            self._max_model_len = llm.llm_engine.model_config.max_model_len
            self._install(probe_heads, probe_hidden_layers, probe_data_mean_layers)
        except BaseException:
            self.close()
            raise

    @property
    def llm(self) -> Any:
        """The raw ``vllm.LLM`` (None once closed). Calls on it bypass the engine lock."""
        return self._handle.llm

    @property
    def engine_pids(self) -> list[int]:
        """The engine's process ids (engine core and workers; empty for an in-process engine)."""
        supervisor = self._handle.supervisor
        return [] if supervisor is None else supervisor.pids

    def _engine_call(self) -> contextlib.AbstractContextManager[Any]:
        """Hold the engine for one call (``EngineHandle.call``): yields the ``vllm.LLM``."""
        return self._handle.call()

    def _install(
        self,
        probe_heads: Sequence[HeadKey] | str | None,
        hidden_layers: Sequence[int],
        data_mean_layers: Sequence[int],
    ) -> None:
        with self._engine_call() as llm:
            info: ModelInfo = llm.collective_rpc(RPC_MODEL_INFO)[0]
        install = self._plan_install(info, probe_heads, hidden_layers, data_mean_layers)
        serial = self._handle.serial_llm(self.tokenizer)
        self.steering = SteeringClient(serial, self.config.model_id, info, self.prepare)
        with refused_as_not_guardable(), self._engine_call() as llm:
            self.model_info = llm.collective_rpc(RPC_INSTALL, args=install.rpc_args)[0]
            if install.reset_prefix_cache:
                llm.reset_prefix_cache()
            self._start_push(llm)
        # Refuse to run unguarded: one real request must come back scored.
        check_self_test(self.generate([SELF_TEST_REQUEST], self.sampling(max_tokens=1))[0])

    def _start_push(self, llm: Any) -> None:
        """Have the workers push results here (``guardrail.engine.inbox``), or keep popping."""
        inbox = ResultInbox()
        weakref.finalize(self, inbox.close)
        if inbox.accepted(llm.collective_rpc(RPC_PUSH_RESULTS, args=inbox.push_args)):
            self._inbox = inbox
            return
        llm.collective_rpc(RPC_PUSH_RESULTS, args=no_push_args())
        inbox.close()

    def _results(self, llm: Any, keys: list[str], tag: str) -> list[PoppedResults]:
        """Every rank's results of ``keys`` (one per rank, as ``ProbeClient.result`` takes
        them): pushed ones as they arrived, the rest popped (a pop first waits for the
        worker's pusher, so a result is then either popped or, if the pop says so, on its way
        here: waited for)."""
        inbox = self._inbox
        if inbox is None:
            return list(llm.collective_rpc(RPC_POP_RESULTS, args=(keys,)))
        found = inbox.take(keys, tag, PUSH_WAIT_S)
        if len(found) == len(keys):
            return [pushed(inbox, found)]
        missing = [k for k in keys if k not in found]
        per_rank = list(llm.collective_rpc(RPC_POP_RESULTS, args=(missing,)))
        on_the_way = in_transit(per_rank)
        late = {}
        if on_the_way:
            late = inbox.take(on_the_way, tag, IN_TRANSIT_WAIT_S, lambda: self._handle.dead)
        return [pushed(inbox, {**found, **late}), *per_rank]

    def prepare(self, request: RequestLike) -> PreparedPrompt:
        """Render one request into token ids and spans (raises ``RequestError`` if invalid)."""
        with self._handle.lock:  # the tokenizer is not safe to share between threads
            return prepare_prompt(request, self.tokenizer, self._max_model_len, self.chat_template)

    def prepare_many(self, requests: Sequence[RequestLike]) -> list[PreparedPrompt | RequestError]:
        """Render a batch, tokenized in one call: each entry a ``PreparedPrompt`` or the
        ``RequestError`` that refused that request alone."""
        with self._handle.lock:
            return prepare_prompts(
                requests, self.tokenizer, self._max_model_len, self.chat_template
            )

    def generate(
        self,
        requests: Sequence[RequestLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        stop_below: float | Sequence[float | None] | None = None,
        stop_on_probe_error: bool | Sequence[bool] = True,
        probe_keys: Sequence[str | None] | None = None,
        steering: SteeringLike | Sequence[SteeringLike | None] | None = None,
        use_tqdm: bool = False,
        stream_positions: Sequence[Sequence[int] | None] | None = None,
    ) -> list[GuardedOutput]:
        """Generate for each request with the probe on; one ``GuardedOutput`` per request, in order.

        ``stop_below`` (one value or one per request) ends a request right after its prefill,
        inside the engine, when its focus is at or below the value (or, with
        ``stop_on_probe_error``, when the probe failed): it decodes a single stop token and
        no more. An invalid request, or an invalid entry of a per-request list (sampling params,
        ``stop_below``, ``stop_on_probe_error``, ``probe_keys``, ``steering``), gets an output
        with ``error`` set naming its index, and is not sent; the others are answered. A request
        whose score did not come back has ``probe.error`` set. ``probe_keys`` (one per request,
        None for a fresh uuid) chooses the key a request's score travels under, e.g. to aim
        ``set_probe_faults`` at one request. ``steering`` (one value or one per request, None =
        unsteered) steers requests with a loaded vector; their output's ``steering`` report says
        how many positions were steered, or why steering failed. Raises ``EngineDeadError`` when
        the engine dies (see the class docstring). ``stream_positions`` (calibration: one list
        of prompt positions, or None, per request) returns each request's whole residual
        streams at those positions, of every layer in ``probe_data_mean_layers``
        (``probe.token_states``).
        """
        if stream_positions is not None and len(stream_positions) != request_count(requests):
            raise ConfigError("stream_positions needs one entry (a list or None) per request")
        args = per_request_args(
            requests,
            sampling_params,
            stop_below,
            stop_on_probe_error,
            probe_keys,
            lambda: self.sampling(max_tokens=64),
        )
        with self._engine_call() as llm:
            steer = self._steering_plan(steering, len(requests), args.errors)
            return self._run(llm, requests, args, steer, use_tqdm, stream_positions)

    def _run(
        self,
        llm: Any,
        requests: Sequence[RequestLike],
        args: PerRequestArgs,
        steer: list[ResolvedSteering | None],
        use_tqdm: bool,
        positions: Sequence[Sequence[int] | None] | None = None,
    ) -> list[GuardedOutput]:
        outputs: list[GuardedOutput | None] = [None] * len(requests)
        batch = _Batch(tag=uuid.uuid4().hex)
        try:
            # Rendered and enqueued a group at a time: the engine starts on the first group
            # while the rest are rendered and tokenized (as vLLM's own generate does with text).
            # Measured on the H200 against larger chunks (docs/gpu.md): starting early wins.
            for group in _groups(len(requests), self.render_group):
                prompts, group_params = self._group(
                    requests, group, args, steer, outputs, batch, positions
                )
                if prompts:
                    llm.enqueue(prompts, group_params, use_tqdm=False)
            # in the order they were enqueued (vLLM sorts them by its request counter)
            results = llm.wait_for_completion(use_tqdm=use_tqdm) if batch.sent else []
        except BaseException:
            self._after_failed_generate(llm, batch)
            raise
        sent, steered = batch.sent, batch.steered
        if not sent:
            return [o for o in outputs if o is not None]
        sent_keys = [k for *_, k in sent]
        per_rank = self._results(llm, sent_keys, batch.tag)
        reports = self.steering.reports(steered)
        _check_order(sent, results)
        for (i, prepared, key), result in zip(sent, results, strict=True):
            completion = result.outputs[0]
            outputs[i] = GuardedOutput(
                index=i,
                prompt=prepared,
                text=completion.text,
                token_ids=list(completion.token_ids),
                finish_reason=completion.finish_reason,
                num_cached_tokens=int(result.num_cached_tokens or 0),
                probe=self.probe.result(per_rank, key),
                steering=reports.get(key),
                logprobs=logprobs_of(completion),
            )
        return [o for o in outputs if o is not None]

    def _group(
        self,
        requests: Sequence[RequestLike],
        group: range,
        args: PerRequestArgs,
        steer: list[ResolvedSteering | None],
        outputs: list[GuardedOutput | None],
        batch: _Batch,
        positions: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """Prepare one group of requests: its prompts and params to enqueue. A request that
        cannot be sent gets its error output here; the others are recorded in ``batch``."""
        from vllm.inputs import TokensPrompt

        errors = args.errors
        todo = [i for i in group if i not in errors]
        rendered = dict(zip(todo, self.prepare_many([requests[i] for i in todo]), strict=True))
        prompts, group_params = [], []
        for i in group:
            try:
                prepared = rendered[i] if i in rendered else errors[i]
                if isinstance(prepared, GuardrailError):
                    raise prepared
                key = args.probe_keys[i] or uuid.uuid4().hex
                stop_below, on_error = args.stop_below[i], bool(args.stop_on_probe_error[i])
                spec = self.probe.spec(
                    prepared,
                    key,
                    args.params[i],
                    stop_below,
                    on_error,
                    tag=batch.tag,
                    stream_positions=None if positions is None else positions[i],
                )
            except GuardrailError as exc:  # this request alone fails
                outputs[i] = GuardedOutput(index=i, prompt=None, error=exc)
                continue
            group_params.append(self.probe.attach(args.params[i], spec))
            prompt = TokensPrompt(prompt_token_ids=prepared.token_ids)
            resolved = steer[i]
            if resolved is not None:  # never reuse KV cached without this steering
                prompt["cache_salt"] = resolved.cache_salt
                group_params[-1].extra_args[STEER_ARG] = resolved.spec(key)
                batch.steered[key] = resolved
            prompts.append(prompt)
            batch.sent.append((i, prepared, key))
        return prompts, group_params

    def _after_failed_generate(self, llm: Any, batch: _Batch) -> None:
        """A failed or interrupted batch must leave nothing behind for the next call: abort its
        unfinished requests, pop its results and reports (its pushed results carry its tag,
        which no later call takes). Never masks the original error."""
        if not self._handle.dead:
            with contextlib.suppress(Exception):
                abort_unfinished(llm)
                llm.collective_rpc(RPC_POP_RESULTS, args=([k for *_, k in batch.sent],))
                self.steering.reports(batch.steered)
        if self._inbox is not None:
            self._inbox.drop(batch.tag)

    def score(
        self,
        requests: Sequence[RequestLike],
        stream_positions: Sequence[Sequence[int] | None] | None = None,
    ) -> list[GuardedOutput]:
        """Run the probe alone: prefill plus one sampled token, no text worth reading
        (``stream_positions``: see ``generate``)."""
        return self.generate(
            requests, self.sampling(max_tokens=1), stream_positions=stream_positions
        )

    # -- per-request arguments -------------------------------------------------------------------
    def _steering_plan(
        self,
        steering: SteeringLike | Sequence[SteeringLike | None] | None,
        n: int,
        errors: dict[int, GuardrailError],
    ) -> list[ResolvedSteering | None]:
        """One value for all requests is checked as a whole (a bad one fails the call); a bad
        entry of a list fails its own request."""
        if steering is None or isinstance(steering, str | Steering | Mapping):
            return self.steering.plan(steering, n)
        if not isinstance(steering, Sequence) or len(steering) != n:
            raise ConfigError(
                f"steering must be one value, or a list with one value (or None) per request: "
                f"{n} requests"
            )
        plan: list[ResolvedSteering | None] = []
        for i, entry in enumerate(steering):
            try:
                plan.append(None if entry is None else self.steering.plan([entry], 1)[0])
            except (ConfigError, EngineNotGuardableError) as exc:
                errors.setdefault(i, RequestError(f"request {i}: steering: {exc}"))
                plan.append(None)
        return plan

    def set_probe_faults(self, keys: Sequence[str]) -> None:
        """Testing hook: make the probe fail for requests whose probe key is in ``keys``."""
        with self._engine_call() as llm:
            llm.collective_rpc(RPC_SET_FAULTS, args=(list(keys),))

    # -- steering (the ``steering`` component; these are its public face) -----------------------
    @property
    def steering_vectors(self) -> dict[str, SteeringVector]:
        """The vectors loaded in the workers, by name."""
        return self.steering.vectors

    def load_steering_vector(self, vector: str | Path | SteeringVector) -> SteeringVector:
        """Validate a vector against the served model and load it in the workers (by name)."""
        with self._handle.lock:
            return self.steering.load(vector)

    def unload_steering_vector(self, name: str | None = None) -> None:
        """Remove one vector (or all, with None)."""
        with self._handle.lock:
            self.steering.unload(name)

    @contextlib.contextmanager
    def steering_vector(self, vector: str | Path | SteeringVector) -> Iterator[SteeringVector]:
        """Load a vector for the ``with`` block (see ``SteeringClient.vector``)."""
        with self.steering.vector(vector) as loaded:
            yield loaded

    def continuation_logprobs(
        self,
        requests: Sequence[RequestLike],
        continuations: Sequence[str],
        steering: SteeringLike | Sequence[SteeringLike | None] | None = None,
    ) -> list[list[float]]:
        """Teacher-forced log-probabilities of continuations (``SteeringClient``)."""
        with self._handle.lock:  # one call: its steering reports are popped before another runs
            return self.steering.continuation_logprobs(requests, continuations, steering)

    def capture_residuals(
        self, requests: Sequence[RequestLike], layers: Sequence[int]
    ) -> list[dict[int, torch.Tensor]]:
        """The residual stream at each request's last prompt token (``SteeringClient``)."""
        with self._handle.lock:  # the capture layers are engine state for the whole call
            return self.steering.capture_residuals(requests, layers)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down, free its memory, and make sure none of its processes or shared
        memory is left. Idempotent; waits for a call another thread is running."""
        self._handle.close()
        if self._inbox is not None:
            self._inbox.close()
        self._finalizer.detach()

    def __enter__(self) -> HookedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Batch:
    """What one ``generate`` call has sent so far: (index, prompt, probe key) per request, in
    order, and the steered requests by key."""

    tag: str  # sent with every request's probe spec: its pushed result comes back with it
    sent: list[tuple[int, PreparedPrompt, str]] = field(default_factory=list)
    steered: dict[str, ResolvedSteering] = field(default_factory=dict)


def _groups(n: int, size: int) -> Iterator[range]:
    """Request indices ``0 .. n-1`` in consecutive groups of ``size`` (the last may be short).

    Example:
        >>> [list(g) for g in _groups(5, 2)]
        [[0, 1], [2, 3], [4]]
    """
    for start in range(0, n, size):
        yield range(start, min(start + size, n))


def _check_order(sent: Sequence[tuple[int, PreparedPrompt, str]], results: Sequence[Any]) -> None:
    """Every output must be its own request's: same count, same prompt token ids, in order."""
    if len(results) != len(sent) or any(
        list(result.prompt_token_ids or []) != prepared.token_ids
        for (_, prepared, _), result in zip(sent, results, strict=False)
    ):
        raise GuardrailError(
            f"the engine returned {len(results)} outputs for {len(sent)} requests, or outputs of "
            "other requests; none of this call's results is used"
        )
