"""A guarded FastAPI service with its Prometheus metrics mounted at /metrics (docs/metrics.md).

    python examples/guarded_service.py --port 8000       # the embedded SmolLM2-135M model
    python examples/guarded_service.py --model DIR --probe-config my-model.json --port 8000
    curl -s localhost:8000/summarize -H 'content-type: application/json' \\
        -d '{"email": "Hi Sam, the offsite moved to Thursday."}'
    curl -s localhost:8000/metrics/ | grep guardrail_requests_total

The engine starts with the app (FastAPI's lifespan) and stops with it (Ctrl-C). FastAPI runs the
plain ``def`` endpoint in worker threads; concurrent calls are safe, as ``GuardedLLM`` runs one
engine call at a time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from prometheus_client import REGISTRY
from pydantic import BaseModel
from vllm import SamplingParams

from guardrail import GuardedLLM, policies
from guardrail.metrics import GuardrailMetrics, make_asgi_app

TASK = "Summarize the email in one sentence."


class Email(BaseModel):
    email: str


def create_app(model: str | None, probe_config: str | None) -> FastAPI:
    guard: dict[str, GuardedLLM] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with GuardedLLM(
            model,
            policies.TIERED,
            probe_config=probe_config,
            metrics=GuardrailMetrics(REGISTRY, model_name="smollm2"),  # the global registry
            model_name="smollm2",
            enforce_eager=True,
        ) as guarded:
            guard["llm"] = guarded
            yield

    app = FastAPI(lifespan=lifespan)
    app.mount("/metrics", make_asgi_app())  # serves the global registry

    @app.post("/summarize")
    def summarize(body: Email) -> dict[str, str | float | None]:
        params = SamplingParams(temperature=0.0, max_tokens=48)
        result = guard["llm"].generate([(TASK, body.email)], params)[0]
        verdict = result.verdict
        assert verdict is not None  # set for every valid request
        return {"action": verdict.action.value, "focus": verdict.focus, "text": result.text}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="A guarded FastAPI service")
    parser.add_argument("--model", default=None, help="model dir or id (default: embedded)")
    parser.add_argument("--probe-config", default=None, help="probe config JSON for the model")
    parser.add_argument("--port", type=int, default=8000, help="port to serve on")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own logs too")
    args = parser.parse_args()
    from guardrail.console import quiet_engine_logs

    quiet_engine_logs(args.verbose)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # CPU builds of vLLM need a KV size
    app = create_app(args.model, args.probe_config)
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, log_level="info" if args.verbose else "warning"
    )


if __name__ == "__main__":  # needed on CPU: vLLM starts its engine process with `spawn`
    main()
