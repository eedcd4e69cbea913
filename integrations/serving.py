"""A guarded OpenAI-compatible server: ``/v1/chat/completions`` and ``/v1/completions`` (streaming
and not), ``/v1/models``, ``/health`` and ``/metrics``, over one ``AsyncGuardedLLM``.

Start it with ``guardrail-serve`` (``--model``, ``--host``, ``--port``, ``--threshold``, and
vLLM engine arguments as ``--engine-arg key=value``) or build the app with
``build_app(guard)`` and serve it with any ASGI server.

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
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from guardrail.errors import (
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    GuardrailError,
    RequestError,
)
from guardrail.guard.async_guarded import AsyncGuardedLLM, GuardedStreamChunk
from guardrail.metrics.http import make_asgi_app
from guardrail.metrics.recorder import GuardrailMetrics
from guardrail.policy.verdict import Verdict
from guardrail.probe.prompts import GuardedPrompt, Message, Segment

__all__ = ["ChatRequest", "CompletionRequest", "build_app", "main"]

# -- the wire format --------------------------------------------------------------------------


class _Sampling(BaseModel):
    """The OpenAI sampling fields this server honours; other OpenAI fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    user: str | None = None

    def sampling_params(self, default_max_tokens: int) -> Any:
        from vllm import SamplingParams

        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop or None,
        )


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str
    guardrail_kind: Literal["instruction", "data"] | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[_Part] | None = None
    trusted: bool | None = None

    def message(self) -> Message:
        if self.content is None or isinstance(self.content, str):
            return Message(role=self.role, content=self.content or "", trusted=self.trusted)
        default = Message(role=self.role, content="", trusted=self.trusted).segments()[0].kind
        parts = [Segment(text=p.text, kind=p.guardrail_kind or default) for p in self.content]
        return Message(role=self.role, content=parts)


class ChatRequest(_Sampling):
    messages: list[_ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)
    data: str | None = None


# -- answers ----------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str, code: str | None = None, **extra: Any) -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code, **extra}}
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
    """Formats one request's chunks as an OpenAI chat or text completion."""

    def __init__(self, chat: bool, model: str, request_id: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _choice(self, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        content: dict[str, Any] = {"role": "assistant", "content": text}
        return {"index": 0, key: content, "logprobs": None, "finish_reason": finish}

    def whole(self, text: str, finish: str | None, verdict: Verdict, usage: dict[str, int]) -> Any:
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(text, finish, delta=False)],
            "usage": usage,
            "guardrail": _verdict_json(verdict),
        }

    def chunk(self, chunk: GuardedStreamChunk) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(chunk.text, chunk.finish_reason, delta=True)],
        }
        if chunk.verdict is not None:
            body["guardrail"] = _verdict_json(chunk.verdict)
        return f"data: {json.dumps(body)}\n\n"


# -- the app ----------------------------------------------------------------------------------


def build_app(
    start: Callable[[], Awaitable[AsyncGuardedLLM]],
    *,
    served_model_name: str | None = None,
    registry: CollectorRegistry | None = None,
    default_max_tokens: int = 256,
) -> FastAPI:
    """The guarded server's app. ``start`` builds the guard on the server's event loop (at
    start-up); ``registry`` is where the guard's metrics are (``/metrics`` serves it)."""
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        guard = await start()
        state["guard"] = guard
        state["model"] = served_model_name or guard.model_name
        try:
            yield
        finally:
            guard.close()

    app = FastAPI(title="vllm-guardrail", lifespan=lifespan)
    app.mount("/metrics", make_asgi_app(registry))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in exc.errors()
        )
        return _error(400, f"invalid request: {problems}", "invalid_request_error")

    @app.get("/health")
    async def health() -> Response:
        guard: AsyncGuardedLLM = state["guard"]
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
            "data": [{"id": state["model"], "object": "model", "owned_by": "vllm-guardrail"}],
        }

    async def answer(body: ChatRequest | CompletionRequest) -> Response:
        if body.model != state["model"]:
            return _error(
                404,
                f"the model {body.model!r} does not exist; this server serves {state['model']!r}",
                "invalid_request_error",
                "model_not_found",
            )
        guard: AsyncGuardedLLM = state["guard"]
        chat = isinstance(body, ChatRequest)
        try:
            request: Any = (
                [m.message() for m in body.messages]
                if isinstance(body, ChatRequest)
                else GuardedPrompt(instruction=body.prompt, data=body.data)
                if body.data
                else body.prompt
            )
        except ValidationError as exc:
            return _error(
                400, f"invalid messages: {exc.errors()[0]['msg']}", "invalid_request_error"
            )
        try:
            params = body.sampling_params(default_max_tokens)
        except ValueError as exc:  # vLLM's own checks of the sampling values
            return _error(400, f"invalid sampling parameters: {exc}", "invalid_request_error")
        request_id = uuid.uuid4().hex
        form = _Answer(chat, state["model"], request_id)
        chunks = guard.stream(request, params, request_id=request_id)
        try:
            first = await anext(chunks)
        except (RequestError, ConfigError) as exc:
            return _error(400, str(exc), "invalid_request_error")
        except (EngineDeadError, EngineClosedError) as exc:
            return _error(503, f"the engine cannot answer: {exc}", "engine_dead")
        except GuardrailError as exc:
            return _error(500, f"the guardrail failed: {exc}", "guardrail_error")
        verdict = first.verdict
        if verdict is None:  # the guard always decides on the first chunk
            return _error(500, "no verdict for this request", "guardrail_error")
        if verdict.blocked:
            await chunks.aclose()
            return _blocked(verdict)
        if body.stream:
            return StreamingResponse(
                _sse(form, first, chunks), media_type="text/event-stream", headers=_headers(verdict)
            )
        text, finish, completion_tokens = [first.text], first.finish_reason, len(first.token_ids)
        async for chunk in chunks:
            text.append(chunk.text)
            finish = chunk.finish_reason
            completion_tokens += len(chunk.token_ids)
        usage = {
            "prompt_tokens": verdict.num_prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": verdict.num_prompt_tokens + completion_tokens,
        }
        return JSONResponse(
            form.whole("".join(text), finish, verdict, usage), headers=_headers(verdict)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest) -> Response:
        return await answer(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        return await answer(body)

    return app


async def _sse(
    form: _Answer, first: GuardedStreamChunk, rest: AsyncIterator[GuardedStreamChunk]
) -> AsyncIterator[str]:
    yield form.chunk(first)
    async for chunk in rest:
        yield form.chunk(chunk)
    yield "data: [DONE]\n\n"


# -- the command ------------------------------------------------------------------------------


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-arg takes key=value, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


def main(argv: list[str] | None = None) -> None:
    """``guardrail-serve``: the guarded OpenAI-compatible server on one model."""
    parser = argparse.ArgumentParser(prog="guardrail-serve", description=main.__doc__)
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--probe-config", default=None, help="model config JSON")
    parser.add_argument("--threshold", type=float, default=None, help="block at or below")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=256, help="when a request sets none")
    parser.add_argument(
        "--engine-arg", type=_engine_arg, action="append", default=[], metavar="KEY=VALUE"
    )
    parser.add_argument("--verbose", action="store_true", help="show vLLM's logs")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's CPU build needs a KV size (GiB)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # engine queues on loopback

    import uvicorn

    from guardrail.console import quiet_engine_logs

    if not args.verbose:
        quiet_engine_logs()
    registry = CollectorRegistry()
    engine_kwargs = {"dtype": "float32", "enforce_eager": True, **dict(args.engine_arg)}
    policies = None if args.threshold is None else [{"threshold": args.threshold}]

    async def start() -> AsyncGuardedLLM:
        return await AsyncGuardedLLM.create(
            args.model,
            policies,
            probe_config=args.probe_config,
            metrics=GuardrailMetrics(registry),
            model_name=args.served_model_name,
            **engine_kwargs,
        )

    app = build_app(
        start,
        served_model_name=args.served_model_name,
        registry=registry,
        default_max_tokens=args.max_tokens,
    )
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning"
    )


if __name__ == "__main__":
    main()
