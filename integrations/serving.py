"""A guarded OpenAI-compatible server: ``/v1/chat/completions`` and ``/v1/completions`` (streaming
and not), ``/v1/models``, ``/health`` and ``/metrics``, over one ``AsyncGuardedLLM``.

Start it with ``guardrail-serve [MODEL]`` (``--host``, ``--port``, ``--probe-config``,
``--threshold``, and vLLM's own engine flags, as ``vllm serve`` takes them: ``--max-model-len``,
``--dtype``, ``--tensor-parallel-size``, ...) or build the app with ``build_app(start)`` and serve
it with any ASGI server.

Why not vLLM's own OpenAI server: it renders each chat through the model's template itself and
hands the engine a prompt, so the guardrail could neither place the instruction and data spans
where the template put each message (it would have to search the rendered text, which data can
fool) nor keep message content from producing control tokens (a forged chat turn), and it has
no per-request hook to attach the probe's spec. This server keeps vLLM's engine (``AsyncLLM``,
with its batching, scheduling and parallelism) and vLLM's HTTP stack (FastAPI on uvicorn), and
renders requests with the guardrail's own renderer (``guardrail.probe.prompts``).

Marking untrusted data, per request:

- chat: messages with role ``tool`` (or any role other than system / user / developer, e.g.
  ``document``) are data; ``"trusted": false`` on any message makes it data, ``true`` trusted;
- inside one message, content parts may say their kind: ``{"type": "text", "text": "...",
  "guardrail_kind": "data"}`` (``"instruction"`` or ``"data"``; unmarked parts follow the
  message);
- ``/v1/completions``: ``prompt`` is the trusted instruction; an extra ``"data"`` field holds the
  untrusted data it works on.

Answers carry the verdict: a ``guardrail`` field in the body (the first chunk of a stream) and the
headers ``x-guardrail-action``, ``x-guardrail-focus`` and ``x-guardrail-request-id``. A blocked
request is answered with HTTP 403 and an OpenAI-style error body (``type``
``"prompt_injection_blocked"``, ``code`` ``"blocked"``) with the verdict, before any token is
sent, streaming or not. Bad requests get a 400 (404 for an unknown model) with a message saying
what was wrong; a dead engine gives 503. Nothing unguarded is ever answered.

A request whose client goes away is aborted in the engine, streamed or not: the handler races
the generation against the connection's ``http.disconnect`` (as vLLM's own server does), and a
stream's response watches it while it sends.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from guardrail.policies.files import load_policy_file
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from guardrail.embedded import model_or_embedded
from guardrail.engine.install import engine_probe_config
from guardrail.engine.types import PositionLogprobs
from guardrail.errors import (
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    GuardrailError,
    RequestError,
)
from guardrail.guard.async_guarded import AsyncGuardedLLM, GuardedStreamChunk
from guardrail.metrics.http import make_asgi_app, merged_registry, scrape_registry
from guardrail.metrics.recorder import GuardrailMetrics
from guardrail.policy import ModelThresholds, Policy
from guardrail.policy.verdict import Verdict
from guardrail.probe.prompts import ChatWithTools, GuardedPrompt, Message

from ._openai_logprobs import RequestLogprobs
from ._openai_tools import ToolCalling, ToolCallReader
from ._openai_wire import ChatRequest, CompletionRequest
from ._serve_args import build_parser, chat_template_text
from ._server_gate import DEFAULT_MAX_BODY_BYTES, RequestGate
from ._server_marking import DelimitedData

__all__ = ["ChatRequest", "CompletionRequest", "build_app", "main"]

logger = logging.getLogger(__name__)

# -- answers ----------------------------------------------------------------------------------


def _error(
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    **extra: Any,
) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code, **extra}}
    return JSONResponse(body, status_code=status)


def _verdict_json(verdict: Verdict) -> dict[str, Any]:
    return verdict.model_dump(mode="json")


def _headers(verdict: Verdict) -> dict[str, str]:
    focus = verdict.focus
    return {
        "x-guardrail-action": verdict.action.value,
        "x-guardrail-focus": "" if focus is None else f"{focus:.6f}",
        "x-guardrail-request-id": verdict.request_id,
    }


def _blocked(verdict: Verdict) -> Response:
    response = _error(
        403,
        f"blocked by the prompt-injection guardrail: {verdict.reason}",
        "prompt_injection_blocked",
        "blocked",
        guardrail=_verdict_json(verdict),
    )
    response.headers.update(_headers(verdict))
    return response


class _Answer:
    """Formats one request's chunks as an OpenAI chat or text completion; ``logprobs``: how
    its logprobs are rendered, when it asked for them."""

    def __init__(
        self,
        chat: bool,
        model: str,
        request_id: str,
        logprobs: RequestLogprobs | None = None,
        role: str = "assistant",
    ) -> None:
        self.chat = chat
        self.role = role  # the answer's role (``--response-role``, as ``vllm serve``)
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.logprobs = logprobs

    def _choice(
        self,
        text: str | None,
        finish: str | None,
        delta: bool,
        logprobs: dict[str, Any] | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        key = "delta" if delta else "message"
        content: dict[str, Any] = {"role": self.role, "content": text}
        if tool_calls is not None:
            content["tool_calls"] = tool_calls
        return {"index": 0, key: content, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(
        self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs] | None
    ) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs.render(token_ids, positions)

    def whole(
        self,
        text: str,
        finish: str | None,
        verdict: Verdict,
        usage: dict[str, int],
        token_ids: Sequence[int] = (),
        positions: Sequence[PositionLogprobs] | None = None,
        tools: ToolCallReader | None = None,
    ) -> Any:
        """The whole answer; ``tools``: how tool calls are read from ``text`` (a chat whose
        tools may be called)."""
        logprobs = self._logprobs(token_ids, positions)
        content: str | None = text
        calls: list[dict[str, Any]] | None = None
        if tools is not None:
            content, calls, finish = tools.read(text, finish)
        choice = self._choice(content, finish, delta=False, logprobs=logprobs, tool_calls=calls)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
            "guardrail": _verdict_json(verdict),
        }

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"

    def chunk(self, chunk: GuardedStreamChunk, with_usage: bool = False) -> str:
        """One event; ``with_usage``: with ``"usage": null``, as OpenAI sends every chunk but
        the last when the client asked for usage."""
        extra: dict[str, Any] = {"usage": None} if with_usage else {}
        if chunk.verdict is not None:
            extra["guardrail"] = _verdict_json(chunk.verdict)
        logprobs = self._logprobs(chunk.token_ids, chunk.logprobs)  # this chunk's tokens'
        choice = self._choice(chunk.text, chunk.finish_reason, delta=True, logprobs=logprobs)
        return self._event([choice], **extra)

    def usage(self, usage: dict[str, int]) -> str:
        """The last event of a stream that asked for usage (``stream_options.include_usage``):
        no choices, the request's token counts."""
        return self._event([], usage=usage)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone away (the connection's ``http.disconnect``). The body
    must have been read already: every other message is dropped."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s response, or, when the client goes away first, ``work`` cancelled (which
    closes its guarded stream: vLLM aborts the request in the engine) and a 499 nobody reads.

    vLLM's server does the same (``with_cancellation``); Starlette's ``is_disconnected`` polled
    in a loop would do it too, later. A streamed response, once returned, watches the
    connection itself."""
    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({handler, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not handler.done():
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler  # the stream closes (the engine aborts) before the handler returns
    if handler.cancelled():
        logger.info("client disconnected; its request was aborted")
        return Response(status_code=499)
    return handler.result()


# -- the app ----------------------------------------------------------------------------------


POLICIES_HEADER = "x-guardrail-policies"
"""A request header naming one of the server's policy sets (``--policies FILE``, ``overrides``)."""

ENGINE_EXIT_WAIT_S = 60.0
"""How long the server waits for an engine core that is already exiting on its own."""


def _engine_cores_exiting() -> list[Any]:
    """This server's vLLM engine-core processes that are already tearing down on their own.

    Ctrl-C in a terminal sends SIGINT to the whole process group, so vLLM's engine core gets
    its own and starts its teardown, for which it puts SIGTERM back to the default action
    (``run_engine_core``'s ``finally``, vllm/v1/engine/core.py). The server's shutdown, vLLM's
    ``AsyncLLM.shutdown``, sends it SIGTERM, which would then kill it half-way: its worker
    orphaned, the shared memory it created never unlinked ("resource_tracker: There appear to
    be 1 leaked shared_memory objects"). A core that still catches SIGTERM (the server alone
    got the signal) is left to vLLM's shutdown. Read from ``/proc/PID/status`` (``SigCgt``);
    elsewhere none is found."""
    term = 1 << (signal.SIGTERM - 1)
    exiting = []
    for proc in multiprocessing.active_children():
        if not proc.name.startswith("EngineCore"):  # vLLM names them EngineCore[_DPn]
            continue
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            continue
        caught = [int(line.split()[1], 16) for line in status.splitlines() if line[:7] == "SigCgt:"]
        if caught and not caught[0] & term:
            exiting.append(proc)
    return exiting


async def _let_exiting_engine_finish() -> None:
    """Wait (at most ``ENGINE_EXIT_WAIT_S``) for engine cores exiting on their own to finish,
    before vLLM's shutdown signals them. Meanwhile vLLM's output handler finds the engine gone
    and would log that as an error with a traceback: expected here, so not logged."""
    exiting = _engine_cores_exiting()
    if not exiting:
        return
    output_handler = logging.getLogger("vllm.v1.engine.async_llm")
    level = output_handler.level
    output_handler.setLevel(logging.CRITICAL)
    try:
        for proc in exiting:
            await asyncio.to_thread(proc.join, ENGINE_EXIT_WAIT_S)
        await asyncio.sleep(0)  # the output handler's last turn
    finally:
        output_handler.setLevel(level)


@dataclass
class _Served:
    """What the app's handlers share: its fixed settings, and, once the lifespan has started
    the guard, the guard and the served model's facts (one app, one guard; nothing per call)."""

    served_model_name: str | None
    default_max_tokens: int
    policy_sets: dict[str, Sequence[Policy]]
    data_marking: DelimitedData | None
    tool_calling: ToolCalling
    response_role: str = "assistant"
    guard: Any = None  # AsyncGuardedLLM, once started
    model: str = ""
    max_model_len: int = 0
    logprob_limits: tuple[int, int] = (0, 0)
    tokenizer: Any = None  # the engine's: vLLM's tool parsers read with it
    tool_parser_class: Any = None  # vLLM's composed parser, with the tool flags

    def started(self, guard: AsyncGuardedLLM) -> None:
        """Hold the started ``guard`` and read what the checks need from its engine."""
        self.guard = guard
        self.model = self.served_model_name or guard.model_name
        model_config = guard.engine.engine.model_config
        self.max_model_len = model_config.max_model_len
        self.logprob_limits = _logprob_limits(model_config)
        self.tokenizer = guard.engine.engine.get_tokenizer()
        self.tool_parser_class = self.tool_calling.parser_class(self.tokenizer)


def build_app(
    start: Callable[[], Awaitable[AsyncGuardedLLM]],
    *,
    served_model_name: str | None = None,
    registry: CollectorRegistry | None = None,
    default_max_tokens: int = 256,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_BODY_BYTES,
    policy_sets: Mapping[str, Sequence[Policy]] | None = None,
    data_marking: DelimitedData | None = None,
    tool_calling: ToolCalling | None = None,
    response_role: str = "assistant",
) -> FastAPI:
    """The guarded server's app. ``start`` builds the guard on the server's event loop (at
    start-up; the running app holds it as ``app.state.guard``); ``registry`` is where the
    guard's metrics are (``/metrics`` serves it). ``api_key``: the key every ``/v1`` request
    must bring (``Authorization: Bearer``); ``max_request_bytes``: larger bodies are a 413
    (``_server_gate.RequestGate``). ``policy_sets``: named policy sets a request may pick
    instead of the guard's own, with the header ``x-guardrail-policies: NAME``.
    ``data_marking``: a server-side rule marking delimited text as data
    (``_server_marking.DelimitedData``). ``tool_calling``: ``--enable-auto-tool-choice`` and
    ``--tool-call-parser`` (``_openai_tools``; default: neither, so tools are rendered only
    with ``tool_choice: "none"``). ``response_role``: the role of every chat answer, as
    ``vllm serve --response-role``."""
    served = _Served(
        served_model_name,
        default_max_tokens,
        dict(policy_sets or {}),
        data_marking,
        tool_calling or ToolCalling(),
        response_role,
    )
    app = FastAPI(title="vllm-guardrail", lifespan=_lifespan(start, served))
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_request_bytes)
    # one scrape: the guardrail's series and the process's default registry, where vLLM's
    # own vllm:* series are (its engine records them when started with stats on)
    app.mount(
        "/metrics", make_asgi_app(merged_registry(scrape_registry(registry), scrape_registry()))
    )
    app.exception_handler(RequestValidationError)(_invalid_request)
    app.exception_handler(StarletteHTTPException)(_http_error)
    _add_info_routes(app, served)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        chosen = request.headers.get(POLICIES_HEADER)
        return await _unless_disconnected(request, _answer(served, body, chosen))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        chosen = request.headers.get(POLICIES_HEADER)
        return await _unless_disconnected(request, _answer(served, body, chosen))

    return app


def _lifespan(
    start: Callable[[], Awaitable[AsyncGuardedLLM]], served: _Served
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: start the guard, hold it while the app serves, close it after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        guard = await start()
        app.state.guard = guard
        served.started(guard)
        try:
            yield
        finally:
            await _let_exiting_engine_finish()
            guard.close()

    return lifespan


async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """A body that does not fit the request model: a 400 listing every problem."""
    errors = exc.errors()
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in errors
    )
    # OpenAI's param: the request field at fault (the first error's, when it names one)
    where = errors[0]["loc"][1:2] if errors else ()
    param = where[0] if where and isinstance(where[0], str) else None
    return _error(400, f"invalid request: {problems}", "invalid_request_error", param=param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Every other 4xx/5xx FastAPI raises (a body it cannot parse: invalid UTF-8, JSON
    nested too deep; an unknown path or method) in the OpenAI error shape."""
    message = str(exc.detail)
    if exc.status_code == 400:
        message = f"invalid request: the body is not valid JSON in UTF-8 ({exc.detail})"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    response = _error(exc.status_code, message, kind)
    response.headers.update(exc.headers or {})
    return response


def _add_info_routes(app: FastAPI, served: _Served) -> None:
    """``/health`` (503 once the engine is dead or closed) and ``/v1/models``."""

    @app.get("/health")
    async def health() -> Response:
        guard: AsyncGuardedLLM = served.guard
        try:
            if guard.engine.engine.errored:
                return _error(503, "the engine is dead", "engine_dead")
        except EngineClosedError:
            return _error(503, "the engine is closed", "engine_closed")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Any:
        return {
            "object": "list",
            "data": [
                {
                    "id": served.model,
                    "object": "model",
                    "owned_by": "vllm-guardrail",
                    "max_model_len": served.max_model_len,  # as vLLM's server says it
                }
            ],
        }


# -- answering a completion request ------------------------------------------------------------


def _refusal(
    served: _Served, body: ChatRequest | CompletionRequest, policy_set: str | None
) -> Response | None:
    """The error answer to a request this server refuses before the engine sees it (an unknown
    policy set or model, too many tokens or logprobs asked for), or None."""
    if policy_set is not None and policy_set not in served.policy_sets:
        return _error(
            400,
            f"x-guardrail-policies: no policy set {policy_set!r} on this server; it has "
            f"{sorted(served.policy_sets)} (guardrail-serve --policies FILE, 'overrides')",
            "invalid_request_error",
        )
    if body.model != served.model:
        return _error(
            404,
            f"the model {body.model!r} does not exist; this server serves {served.model!r}",
            "invalid_request_error",
            "model_not_found",
        )
    if isinstance(body, ChatRequest) and body.tools:
        refused = served.tool_calling.refusal(body.tool_choice_value, body.stream)
        if refused is not None:
            param = "stream" if refused.startswith("stream") else "tool_choice"
            return _error(400, refused, "invalid_request_error", param=param)
    asked = body.max_completion_tokens or body.max_tokens
    if asked is not None and asked >= served.max_model_len:
        return _error(
            400,
            f"max_tokens is {asked}, but this model's maximum context length is "
            f"{served.max_model_len} tokens, prompt included: ask for fewer",
            "invalid_request_error",
        )
    return _too_many_logprobs(body, *served.logprob_limits)


def _guard_request(
    body: ChatRequest | CompletionRequest, data_marking: DelimitedData | None
) -> Any:
    """What the guard is asked: the chat's messages, the completion's prompt (with its data),
    each message marked by ``data_marking`` when the server has one, a chat's tools with it.
    Raises ``ValidationError`` for messages the guard's types refuse."""
    request: Any = (
        [m.message() for m in body.messages]
        if isinstance(body, ChatRequest)
        else GuardedPrompt(instruction=body.prompt, data=body.data)
        if body.data
        else body.prompt
    )
    if data_marking is not None:
        if isinstance(request, str):
            request = [Message(role="user", content=request)]
        if isinstance(request, list):
            request = [data_marking.apply(m) for m in request]
    if isinstance(body, ChatRequest) and body.tools:
        request = ChatWithTools(messages=request, tools=body.tools)
    return request


def _tool_reader(served: _Served, body: ChatRequest | CompletionRequest) -> ToolCallReader | None:
    """How this request's answer is read for tool calls: None unless it is a chat whose tools
    may be called (``tool_choice`` other than "none", served only with the tool flags)."""
    parser = served.tool_parser_class
    if not isinstance(body, ChatRequest) or not body.tools or parser is None:
        return None
    choice = body.tool_choice_value
    if choice == "none":
        return None
    return ToolCallReader(parser, served.tokenizer, body.tools, body.parallel_tool_calls, choice)


async def _first_chunk(
    chunks: AsyncIterator[GuardedStreamChunk],
) -> GuardedStreamChunk | Response:
    """The stream's first chunk (the one carrying the verdict), or the error answer when the
    guard or the engine fails before it."""
    try:
        return await anext(chunks)
    except (RequestError, ConfigError) as exc:
        return _error(400, str(exc), "invalid_request_error")
    except (EngineDeadError, EngineClosedError) as exc:
        return _error(503, f"the engine cannot answer: {exc}", "engine_dead")
    except GuardrailError as exc:
        return _error(500, f"the guardrail failed: {exc}", "guardrail_error")


async def _whole(
    form: _Answer,
    first: GuardedStreamChunk,
    rest: AsyncIterator[GuardedStreamChunk],
    verdict: Verdict,
    tools: ToolCallReader | None = None,
) -> Response:
    """The non-streamed answer: every chunk's text, tokens and logprobs in one body, its tool
    calls read by ``tools``."""
    text, finish, token_ids = [first.text], first.finish_reason, list(first.token_ids)
    positions = list(first.logprobs or ())
    async for chunk in rest:
        text.append(chunk.text)
        finish = chunk.finish_reason
        token_ids.extend(chunk.token_ids)
        positions.extend(chunk.logprobs or ())
    usage = _usage(verdict.num_prompt_tokens, len(token_ids))
    whole = form.whole("".join(text), finish, verdict, usage, token_ids, positions, tools)
    return JSONResponse(whole, headers=_headers(verdict))


async def _answer(
    served: _Served, body: ChatRequest | CompletionRequest, policy_set: str | None
) -> Response:
    """Answer one completion request through the guard: refused, blocked (403, before any
    token), streamed as server-sent events, or whole."""
    refused = _refusal(served, body, policy_set)
    if refused is not None:
        return refused
    guard: AsyncGuardedLLM = served.guard
    chat = isinstance(body, ChatRequest)
    try:
        request = _guard_request(body, served.data_marking)
    except ValidationError as exc:
        return _error(400, f"invalid messages: {exc.errors()[0]['msg']}", "invalid_request_error")
    try:
        params = body.sampling_params(served.default_max_tokens)
    except ValueError as exc:  # vLLM's own checks of the sampling values
        return _error(400, f"invalid sampling parameters: {exc}", "invalid_request_error")
    try:  # vLLM's parser validates the tools again and sets the call's constraint
        tools = _tool_reader(served, body)
        if tools is not None:
            tools.adjust(params)
    except ValueError as exc:
        return _error(400, f"invalid tools: {exc}", "invalid_request_error", param="tools")
    request_id = uuid.uuid4().hex
    top = body.num_logprobs
    logprobs = None if top is None else RequestLogprobs(chat=chat, top=top)
    form = _Answer(chat, served.model, request_id, logprobs, served.response_role)
    policies = None if policy_set is None else served.policy_sets[policy_set]
    chunks = guard.stream(request, params, policies=policies, request_id=request_id)
    first = await _first_chunk(chunks)
    if isinstance(first, Response):
        return first
    verdict = first.verdict
    if verdict is None:  # the guard always decides on the first chunk
        return _error(500, "no verdict for this request", "guardrail_error")
    if verdict.blocked:
        await chunks.aclose()
        return _blocked(verdict)
    if body.stream:
        events = _sse(form, first, chunks, verdict.num_prompt_tokens, body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=_headers(verdict))
    return await _whole(form, first, chunks, verdict, tools)


def _logprob_limits(model_config: Any) -> tuple[int, int]:
    """(the most logprobs per token the engine returns, its vocabulary's size): vLLM's
    ``max_logprobs`` is ``--max-logprobs``, 20 by default, -1 for the whole vocabulary."""
    vocab = int(model_config.get_vocab_size())
    limit = int(model_config.max_logprobs)
    return (vocab if limit == -1 else limit), vocab


def _too_many_logprobs(
    body: ChatRequest | CompletionRequest, limit: int, vocab: int
) -> Response | None:
    """A 400 naming the field when a request asks for more logprobs per token than the engine
    returns (vLLM's own check, ``SamplingParams._validate_logprobs``, would refuse it inside
    the engine); -1 asks for the whole vocabulary, as in ``vllm serve``."""
    asked = body.num_logprobs
    if asked is None or (vocab if asked == -1 else asked) <= limit:
        return None
    field = "top_logprobs" if isinstance(body, ChatRequest) else "logprobs"
    return _error(
        400,
        f"{field} is {asked}, but this server returns at most {limit} logprobs per token "
        "(the engine's --max-logprobs)",
        "invalid_request_error",
        param=field,
    )


async def _sse(
    form: _Answer,
    first: GuardedStreamChunk,
    rest: AsyncIterator[GuardedStreamChunk],
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    yield form.chunk(first, include_usage)
    completion_tokens = len(first.token_ids)
    async for chunk in rest:
        completion_tokens += len(chunk.token_ids)
        yield form.chunk(chunk, include_usage)
    if include_usage:
        yield form.usage(_usage(prompt_tokens, completion_tokens))
    yield "data: [DONE]\n\n"


# -- the command ------------------------------------------------------------------------------


def parse_command(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse ``guardrail-serve``'s command line: the namespace, and the vLLM engine arguments
    to start with: exactly those the command line gives, taken from vLLM's
    ``AsyncEngineArgs.from_cli_args`` (plus any deprecated ``--engine-arg``). Only given flags
    are forwarded, so the library's CPU defaults (``guardrail.engine.defaults``: float32, eager
    mode, the KV cache size) still fill what the user left out, and on a GPU vLLM's own: with
    argparse every field has a value, so what was given is found by parsing again with every
    default suppressed (an explicit ``--no-enforce-eager`` counts as given)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = build_parser()
    args = parser.parse_args(argv)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(argv)))
    model_flag = args.model if "model" in given else None
    if args.model_tag and model_flag and args.model_tag != model_flag:
        parser.error(f"two models: {args.model_tag!r} and --model {model_flag!r}")
    args.model = args.model_tag or model_flag
    names = args.served_model_name if "served_model_name" in given else None
    args.served_model_name = names[0] if names else None
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    engine = AsyncEngineArgs.from_cli_args(args)
    engine_kwargs = {
        name: getattr(engine, name)
        for name in sorted((given & fields) - {"model", "served_model_name"})
    }
    if args.engine_arg:
        print(
            "guardrail-serve: --engine-arg is deprecated; pass vLLM's own flags "
            "(--engine-arg max_model_len=4096 is --max-model-len 4096)",
            file=sys.stderr,
        )
        engine_kwargs.update(dict(args.engine_arg))
    return args, engine_kwargs


def main(argv: list[str] | None = None) -> None:
    """``guardrail-serve``: the guarded OpenAI-compatible server on one model."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's CPU build needs a KV size (GiB)
    from guardrail.console import quiet_engine_logs

    command = sys.argv[1:] if argv is None else argv
    quiet_engine_logs(verbose="--verbose" in command)  # before vLLM is imported (its log level)
    args, engine_kwargs = parse_command(command)

    import uvicorn

    try:  # before anything starts: a model with no config is told what to run, at once
        tool_calling = ToolCalling(args.enable_auto_tool_choice, args.tool_call_parser)
        chat_template = chat_template_text(args.chat_template)
        model = str(model_or_embedded(args.model))
        config = engine_probe_config(model, args.probe_config, engine_kwargs, announce=False)
    except GuardrailError as exc:
        print(f"guardrail-serve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # vLLM's own metrics on (as vllm serve has them), labelled with the name the guardrail's
    # series carry, so dashboards join the two on model_name
    served_name = args.served_model_name or config.model_id
    engine_kwargs.setdefault("disable_log_stats", False)
    engine_kwargs.setdefault("served_model_name", served_name)
    policies: Sequence[Any] | None = None
    overrides: dict[str, tuple[Policy, ...]] = {}
    if args.threshold is not None:
        policies = [{"threshold": args.threshold}]
    if args.policies is not None:
        if args.threshold is not None:
            print("guardrail-serve: give --policies or --threshold, not both", file=sys.stderr)
            raise SystemExit(2)
        try:  # validated against the served model's config before anything starts
            loaded = load_policy_file(args.policies, ModelThresholds.of(config))
        except GuardrailError as exc:
            print(f"guardrail-serve: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        policies, overrides = loaded.default, loaded.overrides
    registry = CollectorRegistry()

    async def start() -> AsyncGuardedLLM:
        guarded = await AsyncGuardedLLM.create(
            model,
            policies,
            probe_config=config,  # resolved once, above
            metrics=GuardrailMetrics(registry),
            model_name=served_name,
            **engine_kwargs,
        )
        guarded.engine.chat_template = chat_template  # before any request: every render uses it
        return guarded

    app = build_app(
        start,
        served_model_name=served_name,
        registry=registry,
        default_max_tokens=args.max_tokens,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        policy_sets=overrides,
        data_marking=None if args.data_between is None else DelimitedData(*args.data_between),
        tool_calling=tool_calling,
        response_role=args.response_role,
    )
    # Exit handlers run last-registered first: the engine's own (a collection that frees the
    # closed engine, registered when it closes) run before this one, which then freezes what is
    # left so that the interpreter's final collections skip the heap (torch, vLLM, transformers:
    # ~700,000 objects, seconds of garbage collection on a busy CPU for memory the exit returns).
    atexit.register(gc.freeze)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning"
    )


if __name__ == "__main__":
    main()
