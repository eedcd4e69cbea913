"""The guarded server's front gate (API key, body limit) over real HTTP on loopback: a small
app behind ``RequestGate`` served by uvicorn, and the server's own app wired with it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from guardrail.integrations._server_gate import RequestGate
from guardrail.integrations.serving import build_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.helpers import uvicorn_in_thread

KEY = "s3cret-key"
LIMIT = 64 * 1024


async def echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"bytes": len(body), "head": body[:16].decode(errors="replace")})


async def health(request: Request) -> Response:
    return Response(status_code=200)


def _app() -> Any:
    routes = [
        Route("/v1/echo", echo, methods=["POST"]),
        Route("/v1/models", health, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", health, methods=["GET"]),
        Route("/echo", echo, methods=["POST"]),
    ]
    return RequestGate(Starlette(routes=routes), api_key=KEY, max_body_bytes=LIMIT)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with uvicorn_in_thread(_app(), log_level="error") as base:
        yield base


AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": KEY},
        {"authorization": f"bearer {KEY}x"},
    ],
)
def test_v1_without_the_right_key_is_a_401_in_the_openai_shape(url: str, headers: Any) -> None:
    for response in (
        httpx.get(f"{url}/v1/models", headers=headers, timeout=10),
        httpx.post(f"{url}/v1/echo", content=b"{}", headers=headers, timeout=10),
    ):
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_key_passes_and_health_and_metrics_need_none(url: str) -> None:
    assert httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200


def test_a_body_within_the_limit_reaches_the_app_unchanged(url: str) -> None:
    body = b"x" * LIMIT
    got = httpx.post(f"{url}/v1/echo", content=body, headers=AUTH, timeout=10).json()
    assert got == {"bytes": LIMIT, "head": "x" * 16}

    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length
        yield b"{abc"
        yield b"y" * 1000

    got = httpx.post(f"{url}/echo", content=chunks(), timeout=10).json()
    assert got == {"bytes": 1004, "head": "{abc" + "y" * 12}


def test_a_large_body_is_a_413_at_once_and_others_are_not_stalled(url: str) -> None:
    """20 MiB announced by Content-Length: refused before it is read; sent chunked, refused
    once the limit is passed. Meanwhile /health answers at once."""
    big = b"x" * (20 * 1024 * 1024)
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/echo", content=big, headers=AUTH, timeout=30)
    assert response.status_code == 413 and time.monotonic() - started < 5
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for _ in range(320):
            yield b"y" * 65536

    latencies: list[float] = []

    def poll() -> None:
        for _ in range(5):
            t = time.monotonic()
            httpx.get(f"{url}/health", timeout=10)
            latencies.append(time.monotonic() - t)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        response = httpx.post(f"{url}/echo", content=chunks(), timeout=30)
    except httpx.HTTPError:  # the server may close while the client still sends
        response = None
    poller.join()
    if response is not None:
        assert response.status_code == 413
    assert max(latencies) < 1.0, latencies


def test_the_server_app_is_behind_the_gate() -> None:
    """``build_app(api_key=..., max_request_bytes=...)``: no route runs for a request the gate
    refuses (the app is never started here: the engine is not needed to refuse)."""

    async def never() -> Any:
        raise AssertionError("the engine must not start for refused requests")

    app = build_app(never, api_key=KEY, max_request_bytes=1024)

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            no_key = await client.post("/v1/chat/completions", json={"model": "m"})
            too_big = await client.post("/v1/chat/completions", content=b"x" * 2048, headers=AUTH)
            return [no_key.status_code, too_big.status_code]

    assert asyncio.run(run()) == [401, 413]


def test_the_gate_refuses_an_empty_key() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        RequestGate(_app(), api_key="")


def test_every_4xx_of_the_server_app_is_in_the_openai_error_shape() -> None:
    """Bodies FastAPI cannot parse (invalid UTF-8, JSON nested 10,000 deep), a field of the
    wrong type, an unknown path or method: each answered as ``{"error": {...}}``, none as
    FastAPI's ``{"detail": ...}``; no engine is needed to refuse them."""

    async def never() -> Any:
        raise AssertionError("the engine must not start for refused requests")

    app = build_app(never)
    json_body = {"content-type": "application/json"}

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [
                await client.post(
                    "/v1/chat/completions", content=b'{"model": "\xff"}', headers=json_body
                ),
                await client.post(
                    "/v1/chat/completions",
                    content=b"[" * 10_000 + b"]" * 10_000,
                    headers=json_body,
                ),
                await client.post("/v1/chat/completions", json={"model": 1}),
                await client.get("/v1/unknown"),
                await client.get("/v1/chat/completions"),
            ]

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [400, 400, 400, 404, 405]
    for response in responses:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", response.text
    assert "not valid JSON" in responses[0].json()["error"]["message"]


def test_the_openai_client_passes_with_its_key_and_is_refused_without(url: str) -> None:
    """The real ``openai`` client sends the key as vLLM's server expects it: accepted with the
    right one, ``AuthenticationError`` (401) with a wrong one."""
    import openai

    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10)
    assert ok.get("/models", cast_to=httpx.Response).status_code == 200
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
        wrong.get("/models", cast_to=httpx.Response)
