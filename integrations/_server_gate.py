"""The guarded server's front gate: an ASGI middleware in front of every route.

Two checks run before a request reaches FastAPI, so neither costs the event loop more than a
header comparison or a byte count:

- **API key** (``--api-key``, or vLLM's ``VLLM_API_KEY``), as ``vllm serve`` checks it: every
  path under ``/v1`` needs ``Authorization: Bearer <key>``, compared in constant time; a missing
  or wrong key is a 401 with an OpenAI-style error. ``/health`` and ``/metrics`` stay open, as
  in ``vllm serve``.
- **Body size**: a body longer than ``max_body_bytes`` is a 413 at once when its
  ``Content-Length`` says so, or as soon as that many bytes have arrived (chunked uploads); the
  rest is never read. A body within the limit is buffered and handed to the app unchanged,
  followed by the connection's own later messages (the disconnect the handlers watch for).

Example:
    >>> app = RequestGate(lambda scope, receive, send: None, api_key="k", max_body_bytes=1024)
    >>> app.max_body_bytes
    1024
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["DEFAULT_MAX_BODY_BYTES", "RequestGate"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body accepted (16 MiB): far above any prompt a served context can hold."""


async def send_error(send: Send, status: int, message: str, kind: str, code: str) -> None:
    """An OpenAI-style error response, sent as raw ASGI messages."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """ASGI middleware: API key on ``/v1`` paths, and a bound on request bodies."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string (or None: no key needed)")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.app = app
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self._expected is not None and str(scope.get("path", "")).startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                await send_error(
                    send,
                    401,
                    "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    "invalid_api_key",
                )
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        await self._bounded(scope, receive, send, headers.get(b"content-length"))

    async def _bounded(
        self, scope: Scope, receive: Receive, send: Send, length: bytes | None
    ) -> None:
        """Read the body (at most ``max_body_bytes``; ``length``: its ``Content-Length``, if
        sent), then run the app on it."""
        too_large = (
            f"the request body is larger than this server accepts ({self.max_body_bytes} "
            "bytes; guardrail-serve --max-request-bytes)"
        )
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_error(send, 413, too_large, "invalid_request_error", "request_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await send_error(send, 413, too_large, "invalid_request_error", "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages: the disconnect

        await self.app(scope, replay, send)
