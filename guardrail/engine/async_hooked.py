"""``AsyncHookedLLM``: the probe on vLLM's ``AsyncLLM``, the engine behind ``vllm serve``.

Same worker extension, same probe specs, same results as the offline ``HookedLLM``; what changes
is how results come back. Requests run concurrently, each as its own stream, and a request's
score is known once its prefill ran, which is when its first output arrives. So a stream's first
chunk carries the request's ``ProbeResult``: a server can decide before the first token leaves,
and a request stopped in-engine (``stop_below``) ends right after its prefill as before.

Scores are pushed by the worker as soon as they reach the host (``guardrail.engine.inbox``), so
the first chunk never waits for a round trip through the engine core, which under load serves
one only between two steps. Where the workers cannot push (pipeline parallelism, another host),
or a result is late, they are popped in batches, never one RPC per request: a ``ResultPopper``
keeps at most one ``RPC_POP_RESULTS`` call in flight, and that call carries the key of every
request whose first output arrived while the previous one ran (under load, one pop serves a
whole engine step's worth of requests; ``popper.calls`` and ``popper.popped`` count them).

Its processes are supervised like ``HookedLLM``'s (``guardrail.engine.engine_process``'s
``EngineSupervisor``, on the event loop the engine was created on): an engine-core or worker
process that dies fails every waiting stream and RPC with ``EngineDeadError`` at once, the rest
of the engine's processes are ended and their shared memory unlinked; ``close()`` fails the
streams still running with ``EngineClosedError``, runs vLLM's shutdown, and leaves no engine
process or ``/dev/shm`` segment of the engine behind. ``engine_pids`` lists the processes.

Example:
    >>> async def main():  # doctest: +SKIP
    ...     async with await AsyncHookedLLM.create() as llm:
    ...         async for chunk in llm.stream(("Summarize the email.", "Hi, lunch at noon?")):
    ...             print(chunk.probe.focus if chunk.probe else "", chunk.text)
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from guardrail.embedded import model_or_embedded
from guardrail.engine.client import per_request_args
from guardrail.engine.engine_process import (
    SHUTDOWN_TIMEOUT_S,
    EngineHandle,
    EngineSupervisor,
    is_engine_dead_error,
)
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
from guardrail.engine.types import (
    STOP_IS,
    GuardedChunk,
    GuardedOutput,
    PositionLogprobs,
    is_stop_value,
    logprobs_of,
)
from guardrail.errors import (
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    EngineNotGuardableError,
    GuardrailError,
    RequestError,
)
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.prompts import PreparedPrompt, RequestLike, prepare_prompt
from guardrail.probe.scoring import HeadKey
from guardrail.protocol import (
    RPC_INSTALL,
    RPC_MODEL_INFO,
    RPC_POP_RESULTS,
    RPC_PUSH_RESULTS,
    ModelInfo,
    PoppedResults,
)

__all__ = ["AsyncHookedLLM", "ResultPopper"]

PerRank = list[PoppedResults]


@functools.cache
def _collect_before_exit() -> None:
    """vLLM's ``AsyncLLM`` shuts down again when it is collected, and a closed one often lives
    on in a reference cycle (its cancelled output task) until the interpreter exits, where that
    second shutdown fails on torn-down modules ("Exception ignored in AsyncLLM.__del__").
    Collecting at ``atexit`` (before modules are torn down) avoids it. Registered once."""
    atexit.register(gc.collect)


def _close_engine(engine: Any, supervisor: EngineSupervisor | None) -> None:
    """Shut vLLM's ``AsyncLLM`` down and leave none of its processes or shared memory: from
    ``AsyncHookedLLM.close``, or from its finalizer (collected, or at interpreter exit, unclosed:
    vLLM's own exit path would force-kill the engine core after 5 s, with a warning)."""
    try:
        if supervisor is not None:
            supervisor.wake_waiters()  # running streams and pops: nothing will feed them
            supervisor.closing()
        engine.shutdown(timeout=SHUTDOWN_TIMEOUT_S)  # let its processes exit on their own
    finally:
        if supervisor is not None:
            supervisor.stop()
    _collect_before_exit()


class ResultPopper:
    """Pops probe results from the workers in batches (see the module docstring).

    ``rpc`` is the engine's ``collective_rpc`` coroutine. ``pop(key)`` waits for the batch that
    carries ``key``; ``forget(key)`` pops it without waiting (a request that ended before its
    first output, so its result, if any, does not stay in the workers).
    """

    def __init__(self, rpc: Callable[..., Awaitable[PerRank]]) -> None:
        self._rpc = rpc
        self._waiting: dict[str, asyncio.Future[PerRank] | None] = {}
        self._task: asyncio.Task[None] | None = None
        self.calls = 0
        self.popped = 0

    async def pop(self, key: str) -> PerRank:
        future: asyncio.Future[PerRank] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        self._start()
        return await future

    def forget(self, key: str) -> None:
        self._waiting.setdefault(key, None)
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, {}
            try:
                per_rank: PerRank = await self._rpc(RPC_POP_RESULTS, args=(list(batch),))
            except Exception as exc:  # every waiter of this batch gets the error
                for future in batch.values():
                    if future is not None and not future.done():
                        future.set_exception(exc)
                continue
            self.calls += 1
            self.popped += len(batch)
            for future in batch.values():
                if future is not None and not future.done():
                    future.set_result(per_rank)


class AsyncHookedLLM(HookedBase):
    """A vLLM ``AsyncLLM`` with the guardrail probe installed in its workers.

    Build it with ``await AsyncHookedLLM.create(model, probe_config, **engine_kwargs)`` (same
    arguments as ``HookedLLM``; the engine arguments go to vLLM's ``AsyncEngineArgs``). Calls
    may run concurrently from one event loop: ``stream`` one request, ``generate`` a list.
    Steering is not available on this engine yet (``steering_vectors`` is empty and
    ``load_steering_vector`` refuses), so retry policies are refused by the async guard.

    Failures: a request whose engine died raises ``EngineDeadError`` (within about a second of
    the death; its message names the process and how it died); a closed engine raises
    ``EngineClosedError``, and so do streams still running when ``close()`` is called.
    ``close()`` shuts vLLM's engine down and leaves none of its processes or shared memory.
    """

    def __init__(self, engine: Any, model: str, config: ModelProbeConfig) -> None:
        """Use ``create``: this wraps an already started ``AsyncLLM``."""
        self._engine: Any = engine
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop vLLM's output task runs on
        self.model = model
        self.config = config
        self.probe_heads: list[HeadKey] = []
        self._tokenizer = engine.get_tokenizer()
        self._max_model_len = engine.model_config.max_model_len
        # Rendering and tokenizing run on one thread of their own: off the event loop (a long
        # request must not stall other clients), one at a time (the tokenizer is not safe to
        # share between threads).
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="guardrail-prepare")
        self.popper = ResultPopper(self._rpc)
        self._supervisor: EngineSupervisor | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @classmethod
    async def create(
        cls,
        model: str | Path | None = None,
        probe_config: ModelProbeConfig | str | Path | None = None,
        *,
        probe_heads: Sequence[HeadKey] | str | None = None,
        probe_hidden_layers: Sequence[int] = (),
        probe_data_mean_layers: Sequence[int] = (),
        **engine_kwargs: Any,
    ) -> AsyncHookedLLM:
        """Start the engine, install the probe, and check one real request comes back scored.
        The arguments are ``HookedLLM``'s (a unit test holds the two signatures equal)."""
        arguments = engine_arguments({"disable_log_stats": True, **engine_kwargs})
        model = model_or_embedded(model)
        config = engine_probe_config(str(model), probe_config, arguments)
        check_sizes_from_files(str(model), config)
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        start = EngineHandle.start_arguments(arguments)
        raw_layers = [*probe_hidden_layers, *probe_data_mean_layers]
        args = AsyncEngineArgs(model=str(model), **stream_tap_arguments(start, config, raw_layers))
        with EngineHandle.spawning():
            engine = AsyncLLMEngine.from_engine_args(args)
        self = cls(engine, str(model), config)
        self.loop = asyncio.get_running_loop()
        try:
            self._supervisor = EngineSupervisor(self._engine, loop=self.loop)
            self._finalizer = weakref.finalize(self, _close_engine, engine, self._supervisor)
            await self._install(probe_heads, probe_hidden_layers, probe_data_mean_layers)
        except BaseException:
            self.close()
            raise
        return self

    async def _install(
        self,
        probe_heads: Sequence[HeadKey] | str | None,
        hidden_layers: Sequence[int],
        data_mean_layers: Sequence[int],
    ) -> None:
        info: ModelInfo = (await self._rpc(RPC_MODEL_INFO))[0]
        install = self._plan_install(info, probe_heads, hidden_layers, data_mean_layers)
        with refused_as_not_guardable():
            self.model_info = (await self._rpc(RPC_INSTALL, args=install.rpc_args))[0]
            if install.reset_prefix_cache:
                await self.engine.reset_prefix_cache()
            await self._start_push()
        # Refuse to run unguarded: one real request must come back scored.
        check_self_test((await self.generate([SELF_TEST_REQUEST], self.sampling(max_tokens=1)))[0])

    async def _start_push(self) -> None:
        """Have the workers push results here (``guardrail.engine.inbox``), or keep popping."""
        inbox = ResultInbox()
        weakref.finalize(self, inbox.close)
        ranks = await self._rpc(RPC_PUSH_RESULTS, args=inbox.push_args)
        if await asyncio.to_thread(inbox.accepted, ranks):
            self._inbox = inbox
            return
        await self._rpc(RPC_PUSH_RESULTS, args=no_push_args())
        inbox.close()

    async def _results(self, key: str, tag: str) -> PerRank:
        """Every rank's results of ``key`` (as ``ProbeClient.result`` takes them): pushed, or
        popped when it did not arrive in time (a pop first waits for the worker's pusher, so
        the result is then either popped or, if the pop says so, on its way here: waited
        for)."""
        inbox = self._inbox
        if inbox is None:
            return await self.popper.pop(key)
        try:
            found = await asyncio.wait_for(inbox.future(key, tag), PUSH_WAIT_S)
            return [pushed(inbox, {key: found})]
        except TimeoutError:
            inbox.unwait(key, tag)
        per_rank = await self.popper.pop(key)
        if key not in in_transit(per_rank):  # popped, or never made
            return per_rank
        engine = self._engine
        stop = (lambda: engine.errored) if engine is not None else None
        late = await asyncio.to_thread(inbox.take, [key], tag, IN_TRANSIT_WAIT_S, stop)
        return [pushed(inbox, late), *per_rank]

    async def _rpc(self, method: str, **kwargs: Any) -> Any:
        return await self.engine.collective_rpc(method, **kwargs)

    @property
    def engine(self) -> Any:
        """vLLM's ``AsyncLLM``; raises ``EngineClosedError`` once closed."""
        if self._engine is None:
            raise EngineClosedError("the engine is closed")
        return self._engine

    @property
    def engine_pids(self) -> list[int]:
        """The engine's processes (engine core and its workers), as recorded at start-up."""
        return [] if self._supervisor is None else self._supervisor.pids

    async def _death_described(self, timeout: float = 0.5) -> None:
        """Give the supervisor a moment to name the process that died: vLLM's own monitor can
        fail the streams just before it (both wake on the same exit)."""
        supervisor = self._supervisor
        deadline = time.monotonic() + timeout
        while (
            self._engine is not None
            and supervisor is not None
            and supervisor.watching
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.01)

    def _dead(self, exc: BaseException | None = None) -> EngineDeadError:
        """The error for a request the engine cannot answer: closed, or dead (and why)."""
        if self._engine is None:
            return EngineClosedError("the engine was closed during the request")
        reason = self._supervisor.reason if self._supervisor is not None else None
        why = reason or f"vLLM reported its engine core dead ({exc or self._engine.dead_error})"
        return EngineDeadError(f"the vLLM engine is dead: {why}; start a new one")

    # -- the GuardEngine facts the guard reads ---------------------------------------------------
    @property
    def steering_vectors(self) -> dict[str, Any]:
        return {}

    def load_steering_vector(self, vector: Any) -> Any:
        raise EngineNotGuardableError(
            "steering is not available on the async engine yet; use HookedLLM (offline) for "
            "retry_with_steering policies"
        )

    def prepare(self, request: RequestLike) -> PreparedPrompt:
        """Render one request into token ids and spans (raises ``RequestError`` if invalid)."""
        return prepare_prompt(request, self._tokenizer, self._max_model_len, self.chat_template)

    # -- requests --------------------------------------------------------------------------------
    async def stream(
        self,
        request: RequestLike,
        sampling_params: Any | None = None,
        *,
        stop_below: float | None = None,
        stop_on_probe_error: bool = True,
        probe_key: str | None = None,
    ) -> AsyncGenerator[GuardedChunk, None]:
        """Generate one request, chunk by chunk (the text and token ids new since the last
        chunk). The first chunk carries the rendered ``prompt`` and the ``probe`` result, and
        arrives right after the prefill; ``stop_below`` ends the request there, inside the
        engine, when its focus is at or below the value (see ``HookedLLM.generate``).

        Raises ``RequestError`` for an invalid request or argument (before anything runs),
        ``EngineDeadError`` or ``EngineClosedError`` when the engine cannot answer.
        """
        tag = uuid.uuid4().hex  # this call's: a result pushed for an earlier one is not taken
        prompt, params, key = await self._request(
            request, sampling_params, stop_below, stop_on_probe_error, probe_key, tag
        )
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA
        popped = False
        try:
            outputs = self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt.token_ids), params, f"guardrail-{key}"
            )
            async for out in outputs:
                chunk = _delta_chunk(out)
                if not popped:  # the first output: the prefill ran, the score is known
                    if list(out.prompt_token_ids or []) != prompt.token_ids:
                        raise GuardrailError(
                            "the engine returned the output of another request; not used"
                        )
                    popped = True
                    probe = self.probe.result(await self._results(key, tag), key)
                    chunk = chunk.first(prompt, probe, int(out.num_cached_tokens or 0))
                yield chunk
        except GuardrailError:
            raise
        except Exception as exc:
            if self._engine is None or is_engine_dead_error(exc) or self._engine.errored:
                await self._death_described()
                raise self._dead(exc) from exc
            raise
        finally:
            if not popped and self._inbox is not None:
                self._inbox.forget(key, tag)
            elif not popped and self._engine is not None:
                self.popper.forget(key)

    async def _request(
        self,
        request: RequestLike,
        sampling_params: Any,
        stop_below: Any,
        stop_on_probe_error: Any,
        probe_key: str | None,
        tag: str,
    ) -> tuple[PreparedPrompt, Any, str]:
        """Check one request's arguments and build its prompt, params (with the probe spec)
        and probe key. Raises ``RequestError`` naming what was wrong."""
        if self.engine.errored:
            raise self._dead()
        from vllm import SamplingParams

        params = self.sampling(max_tokens=64) if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"sampling params must be a vllm.SamplingParams, not {type(params).__name__}"
            )
        if not is_stop_value(stop_below):
            raise RequestError(f"stop_below must be {STOP_IS}")
        if not isinstance(stop_on_probe_error, bool):
            raise RequestError("stop_on_probe_error must be True or False")
        if probe_key is not None and (not isinstance(probe_key, str) or not probe_key):
            raise RequestError("probe_key must be a non-empty string (or None for a fresh key)")
        key = probe_key or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self._preparer, self.prepare, request)
        try:
            spec = self.probe.spec(prepared, key, params, stop_below, stop_on_probe_error, tag)
        except ConfigError as exc:
            raise RequestError(str(exc)) from exc
        return prepared, self.probe.attach(params, spec), key

    async def generate(
        self,
        requests: Sequence[RequestLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        stop_below: float | Sequence[float | None] | None = None,
        stop_on_probe_error: bool | Sequence[bool] = True,
        probe_keys: Sequence[str | None] | None = None,
    ) -> list[GuardedOutput]:
        """Generate every request concurrently; one ``GuardedOutput`` per request, in order.

        The same arguments and per-request failures as ``HookedLLM.generate`` (an invalid
        request or list entry gets an output with ``error`` set and the others are answered).
        Raises ``EngineDeadError`` when the engine dies.
        """
        args = per_request_args(
            requests, sampling_params, stop_below, stop_on_probe_error, probe_keys, lambda: None
        )
        errors = args.errors

        async def one(i: int) -> GuardedOutput:
            if i in errors:
                return GuardedOutput(index=i, prompt=None, error=errors[i])
            try:
                return await self._collect(
                    i,
                    requests[i],
                    args.params[i],
                    args.stop_below[i],
                    args.stop_on_probe_error[i],
                    args.probe_keys[i],
                )
            except RequestError as exc:
                return GuardedOutput(
                    index=i, prompt=None, error=RequestError(f"request {i}: {exc}")
                )

        return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))

    async def _collect(
        self,
        index: int,
        request: RequestLike,
        params: Any,
        stop_below: float | None,
        stop_on_probe_error: bool,
        key: str | None,
    ) -> GuardedOutput:
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[PositionLogprobs] | None = None
        first: GuardedChunk | None = None
        finish_reason = None
        async for chunk in self.stream(
            request,
            params,
            stop_below=stop_below,
            stop_on_probe_error=stop_on_probe_error,
            probe_key=key,
        ):
            first = first or chunk
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                logprobs = [] if logprobs is None else logprobs
                logprobs.extend(chunk.logprobs)
            finish_reason = chunk.finish_reason
        if first is None:  # vLLM yields at least one output per request
            raise GuardrailError(f"request {index}: the engine returned no output")
        return GuardedOutput(
            index=index,
            prompt=first.prompt,
            text="".join(text),
            token_ids=token_ids,
            finish_reason=finish_reason,
            num_cached_tokens=first.num_cached_tokens,
            probe=first.probe,
            logprobs=None if logprobs is None else tuple(logprobs),
        )

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut vLLM's engine down and leave none of its processes or shared memory
        (idempotent). Streams still running raise ``EngineClosedError``. Blocks while vLLM's
        processes exit (seconds: their clean exit, see ``guardrail.engine.engine_process``)."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._inbox is not None:
            self._inbox.close()
        self._preparer.shutdown(wait=False, cancel_futures=True)
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer()  # _close_engine(engine, supervisor), once
        else:
            _close_engine(engine, self._supervisor)
        del engine

    async def __aenter__(self) -> AsyncHookedLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _delta_chunk(out: Any) -> GuardedChunk:
    """One vLLM ``RequestOutput`` of a ``DELTA`` stream as a chunk: what is new since the last."""
    completion = out.outputs[0]
    return GuardedChunk(
        text=completion.text,
        token_ids=list(completion.token_ids),
        finished=out.finished,
        finish_reason=completion.finish_reason,
        logprobs=logprobs_of(completion),  # DELTA: this chunk's tokens' only
    )
