"""``/metrics`` over real HTTP on loopback: the one-call server, the ASGI app, multi-process mode.

Every scrape goes through a socket and is parsed with prometheus_client's own text parser;
assertions are exact deltas between two scrapes. A series absent from a scrape reads as None,
never as zero: a series that must exist at zero is asserted ``== 0``, one that must not exist
``is None``, and a series that appeared between two scrapes is reported apart (``Delta.new``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from guardrail.metrics.http import (
    MULTIPROC_DIR_ENV,
    make_asgi_app,
    mark_process_dead,
    multiprocess_registry,
    scrape_registry,
    start_metrics_server,
)
from guardrail.metrics.recorder import SCORE_BUCKETS, GuardrailMetrics
from guardrail.protocol import ProbeErrorReason
from tests.helpers import allow_or_block, delta, key, parse, sample, scrape, uvicorn_in_thread

ROOT = Path(__file__).resolve().parents[2]


def test_delta_tells_absent_from_zero():
    """The helpers above can fail: absent is None, zero is 0.0, a new series is apart."""
    before = {key("a"): 1.0, key("b"): 0.0}
    got = delta(before, {key("a"): 3.0, key("b"): 0.0, key("c"): 0.0})
    assert got.changed == {key("a"): 2.0, key("b"): 0.0}
    assert got.new == {key("c"): 0.0}
    assert got.moved() == {key("a"): 2.0}
    assert sample(got.changed, "b") == 0.0 and sample(got.changed, "c") is None
    assert sample(got.new, "c") == 0.0 and sample(got.new, "b") is None
    with pytest.raises(AssertionError, match="vanished"):
        delta(before, {key("a"): 1.0})


def test_one_call_server_exposes_exact_deltas_over_http():
    registry = CollectorRegistry()
    metrics = GuardrailMetrics(registry, model_name="m")
    with start_metrics_server(0, registry=registry) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        before = scrape(server.url)
        for focus in (0.9, 0.5, 0.2):
            metrics.observe_verdict(allow_or_block(focus), "m")
        missing = allow_or_block(None, error="no score", error_reason=ProbeErrorReason.MISSING)
        metrics.observe_verdict(missing, "m")
        with metrics.track_in_flight(4):
            during = scrape(server.url)
        after = scrape(server.url)
    got = delta(before, after)
    moved = got.moved()
    # Series of the model exist at zero from the start: they moved.
    assert sample(moved, "guardrail_requests_total", model_name="m", action="allow") == 1
    assert sample(moved, "guardrail_requests_total", model_name="m", action="block") == 3
    assert sample(moved, "guardrail_probe_errors_total", model_name="m", reason="missing") == 1
    scores = {"model_name": "m", "signal": "focus"}
    assert sample(moved, "guardrail_probe_score_count", **scores) == 3
    assert sample(moved, "guardrail_probe_score_bucket", **scores, le="0.5") == 2
    assert sample(moved, "guardrail_probe_score_sum", **scores) == pytest.approx(1.6)
    assert sample(moved, "guardrail_probe_duration_seconds_count", model_name="m") == 3
    assert sample(moved, "guardrail_probe_duration_seconds_bucket", model_name="m", le="0.005") == 3
    duration_fast = {"model_name": "m", "le": "0.0025"}
    assert sample(got.changed, "guardrail_probe_duration_seconds_bucket", **duration_fast) == 0
    assert sample(after, "guardrail_probe_duration_seconds_bucket", **duration_fast) == 0
    # The policy's series were never created (no set_thresholds): they appeared with the verdicts.
    policy = {"model_name": "m", "policy": "block_low", "shadow": "false"}
    assert got.new == {
        key("guardrail_decisions_total", **policy, action="allow"): 1,
        key("guardrail_decisions_total", **policy, action="block"): 3,
        key("guardrail_failure_decisions_total", **policy, mode="fail_closed"): 1,
    }
    assert sample(during, "guardrail_requests_in_flight", model_name="m") == 4
    assert sample(after, "guardrail_requests_in_flight", model_name="m") == 0
    # Nothing else moved: requests 2, errors 1, score count + sum + buckets le >= 0.2 and +Inf,
    # duration count + sum + 12 buckets (le >= 0.005, +Inf).
    score_buckets = sum(b >= 0.2 for b in SCORE_BUCKETS) + 1
    assert len(moved) == 2 + 1 + (2 + score_buckets) + (2 + 12)


def test_closed_server_releases_its_port():
    server = start_metrics_server(0, registry=CollectorRegistry())
    port = server.port
    server.close()
    server.close()  # idempotent
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_asgi_app_serves_the_registry():
    registry = CollectorRegistry()
    metrics = GuardrailMetrics(registry, model_name="m")
    metrics.observe_verdict(allow_or_block(0.3), "m")
    app = make_asgi_app(registry)

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/metrics")

    response = asyncio.run(get())
    samples = parse(response.text)
    assert sample(samples, "guardrail_requests_total", model_name="m", action="block") == 1
    assert sample(samples, "guardrail_requests_total", model_name="m", action="allow") == 0
    assert sample(samples, "guardrail_probe_score_count", model_name="m", signal="focus") == 1


@pytest.fixture()
def uvicorn_app_with_metrics_mounted() -> Iterator[tuple[str, GuardrailMetrics]]:
    """A Starlette app (the shape of vLLM's API server) with ``/metrics`` mounted, on loopback."""
    pytest.importorskip("uvicorn")
    starlette_apps = pytest.importorskip("starlette.applications")
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    registry = CollectorRegistry()
    metrics = GuardrailMetrics(registry, model_name="m")

    async def generate(request: Any) -> Any:
        metrics.observe_verdict(allow_or_block(0.8), "m")
        return PlainTextResponse("ok")

    app = starlette_apps.Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Mount("/metrics", app=make_asgi_app(registry)),
        ]
    )
    with uvicorn_in_thread(app, lifespan="off") as base:
        yield base, metrics


def test_asgi_app_mounted_in_a_real_server(uvicorn_app_with_metrics_mounted):
    base, _ = uvicorn_app_with_metrics_mounted
    before = scrape(f"{base}/metrics/")
    for _ in range(3):
        assert httpx.post(f"{base}/generate", timeout=10).text == "ok"
    after = scrape(f"{base}/metrics")  # without the slash: redirected
    got = delta(before, after)
    requests = {"model_name": "m", "action": "allow"}
    assert sample(got.changed, "guardrail_requests_total", **requests) == 3


def test_scrape_registry_follows_the_multiprocess_directory(tmp_path, monkeypatch):
    mine = CollectorRegistry()
    assert scrape_registry(mine) is mine
    monkeypatch.delenv(MULTIPROC_DIR_ENV, raising=False)
    assert scrape_registry() is REGISTRY
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    merged = scrape_registry()
    assert merged is not REGISTRY
    assert [type(c).__name__ for c in merged._collector_to_names] == ["MultiProcessCollector"]


WRITER = textwrap.dedent("""
    import os, sys
    from types import SimpleNamespace

    import prometheus_client.values
    assert prometheus_client.values.ValueClass.__name__ == "MmapedValue", "not multi-process"
    from guardrail.metrics.recorder import GuardrailMetrics
    from tests.helpers import allow_or_block

    held, *focuses = sys.argv[1:]
    metrics = GuardrailMetrics(prometheus_client.REGISTRY, model_name="mp")
    metrics.set_thresholds([SimpleNamespace(name="block_low", threshold=0.5)])
    for focus in focuses:
        metrics.observe_verdict(allow_or_block(float(focus)))
    in_flight = metrics.track_in_flight(int(held))
    in_flight.__enter__()
    print(os.getpid(), flush=True)
    os._exit(0)  # dies with requests in flight, as a killed worker does
""")


def run_writers(directory: Path, jobs: list[list[str]]) -> list[int]:
    """Start one writer process per job at once, wait for all; their pids."""
    env = {
        **os.environ,
        MULTIPROC_DIR_ENV: str(directory),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, *job],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job in jobs
    ]
    pids = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        pids.append(int(out.strip()))
    return pids


def test_two_processes_write_and_one_scrape_merges_them(tmp_path, monkeypatch):
    pid_a, _ = run_writers(
        tmp_path, [["2", "0.7", "0.8", "0.2"], ["1", "0.9", "0.1", "0.45", "0.55"]]
    )
    assert len(list(tmp_path.glob("*.db"))) >= 4  # counters, histograms, gauges of two pids
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    with start_metrics_server(0) as server:  # registry=None: the multi-process registry
        merged = scrape(server.url)
        mark_process_dead(pid_a)
        after_a_died = scrape(server.url)
    assert sample(merged, "guardrail_requests_total", model_name="mp", action="allow") == 4
    assert sample(merged, "guardrail_requests_total", model_name="mp", action="block") == 3
    assert (
        sample(
            merged,
            "guardrail_decisions_total",
            model_name="mp",
            policy="block_low",
            action="block",
            shadow="false",
        )
        == 3
    )
    scores = {"model_name": "mp", "signal": "focus"}
    assert sample(merged, "guardrail_probe_score_count", **scores) == 7
    assert sample(merged, "guardrail_probe_score_bucket", **scores, le="0.5") == 3
    assert sample(merged, "guardrail_probe_score_sum", **scores) == pytest.approx(3.7)
    assert sample(merged, "guardrail_requests_in_flight", model_name="mp") == 3
    assert sample(after_a_died, "guardrail_requests_in_flight", model_name="mp") == 1
    assert sample(after_a_died, "guardrail_requests_total", model_name="mp", action="allow") == 4
    thresholds = {k: v for k, v in merged.items() if k[0] == "guardrail_policy_threshold"}
    assert list(thresholds.values()) == [0.5]  # one series, no pid label
    build = [k for k in merged if k[0] == "guardrail_build_info"]
    assert len(build) == 1 and "pid" not in dict(build[0][1])


def test_multiprocess_registry_of_an_empty_directory_is_empty(tmp_path):
    with start_metrics_server(0, registry=multiprocess_registry(tmp_path)) as server:
        assert scrape(server.url) == {}
