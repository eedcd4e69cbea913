"""The shipped Grafana dashboard and Prometheus alert rules against the metrics the library exports.

Structure is checked with a JSON schema and plain YAML; every PromQL expression must name
exported metrics with labels they really have. When ``promtool`` (Prometheus' own checker) is
installed, it also parses every expression and runs unit tests of the alerts on synthetic series.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry

from guardrail.metrics.recorder import GuardrailMetrics
from guardrail.policy.verdict import Action, Attempt, FailureMode, PolicyDecision, Verdict

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "monitoring" / "grafana-dashboard.json"
ALERTS = ROOT / "monitoring" / "alerts.yml"
# scripts/setup.sh puts promtool in the environment's bin/ when the system has none on PATH
PROMTOOL = shutil.which("promtool") or shutil.which(
    "promtool", path=str(Path(sys.executable).parent)
)
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Prometheus) not installed")

SELECTOR = re.compile(r"\b(guardrail_[a-z0-9_]+)\b\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"[^"]*"')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
QUANTILE = re.compile(r"histogram_quantile\(\s*([0-9.]+)\s*,(.*)", re.S)
PANEL_TYPES = {"timeseries", "stat", "table", "heatmap", "gauge", "bargauge", "row", "text"}

DASHBOARD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {"type": "array", "items": {"type": "object", "required": ["name", "type"]}}
            },
        },
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos", "datasource", "targets"],
                "properties": {
                    "id": {"type": "integer"},
                    "type": {"enum": sorted(PANEL_TYPES)},
                    "title": {"type": "string", "minLength": 1},
                    "datasource": {"const": {"type": "prometheus", "uid": "${datasource}"}},
                    "gridPos": {
                        "type": "object",
                        "required": ["x", "y", "w", "h"],
                        "properties": {k: {"type": "integer", "minimum": 0} for k in "xywh"},
                    },
                    "targets": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["expr", "refId"],
                            "properties": {
                                "expr": {"type": "string", "minLength": 1},
                                "refId": {"type": "string", "pattern": "^[A-Z]$"},
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every sample name the library exports, with its label names (``le`` for buckets)."""
    metrics = GuardrailMetrics(CollectorRegistry(), model_name="m")
    metrics.set_thresholds([SimpleNamespace(name="p", threshold=0.5)])
    metrics.set_calibrated(False)
    failed = PolicyDecision(
        policy="p", action=Action.ALLOW, failure=FailureMode.FAIL_OPEN, shadow=True, reason="x"
    )
    metrics.observe_verdict(
        Verdict(
            request_id="r",
            action=Action.ALLOW,
            decisions=(failed,),
            scores={"focus": 0.4},
            probe_error="probe: x",
            probe_error_reason="probe",
            reason="x",
            attempts=(Attempt(focus=0.4, action=Action.ALLOW),) * 2,
        )
    )
    names: dict[str, set[str]] = {}
    with metrics.track_in_flight():
        for family in metrics.registry.collect():
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    names.setdefault(sample.name, set()).update(sample.labels)
    return names


def expression_problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What is wrong with one PromQL expression against the exported metrics (empty: nothing)."""
    problems = []
    for opening, closing in ("()", "{}", "[]"):
        if expr.count(opening) != expr.count(closing):
            problems.append(f"unbalanced {opening}{closing}")
    selectors = SELECTOR.findall(expr)
    if not selectors:
        problems.append("names no guardrail metric")
    labels_in_expr: set[str] = set()
    for name, matchers in selectors:
        if name not in exported:
            problems.append(f"{name} is not exported")
            continue
        labels_in_expr |= exported[name]
        problems += [
            f"{name} has no label {label!r}"
            for label in MATCHER.findall(matchers)
            if label not in exported[name]
        ]
    for group in GROUPING.findall(expr):
        problems += [
            f"grouping by unknown label {label!r}"
            for label in (g.strip() for g in group.split(","))
            if label and label not in labels_in_expr
        ]
    for quantile, rest in QUANTILE.findall(expr):
        if not 0 < float(quantile) < 1:
            problems.append(f"quantile {quantile} outside (0, 1)")
        if "_bucket" not in rest or not re.search(r"by \([^)]*\ble\b", rest):
            problems.append("histogram_quantile needs _bucket series summed by le")
    return problems


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    return [
        (f"{p['title']}/{t['refId']}", t["expr"])
        for p in dashboard()["panels"]
        for t in p.get("targets", [])
    ]


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def test_validator_catches_typos(exported):
    """The checks below can fail: a wrong name, label, grouping or bracket is reported."""
    assert (
        expression_problems('sum(rate(guardrail_requests_total{model_name="m"}[5m]))', exported)
        == []
    )
    assert expression_problems("rate(guardrail_request_total[5m])", exported) == [
        "guardrail_request_total is not exported"
    ]
    assert expression_problems('rate(guardrail_requests_total{policy="p"}[5m])', exported) == [
        "guardrail_requests_total has no label 'policy'"
    ]
    assert expression_problems(
        "sum by (reason) (rate(guardrail_requests_total[5m]))", exported
    ) == ["grouping by unknown label 'reason'"]
    assert expression_problems("sum(rate(guardrail_requests_total[5m])", exported) == [
        "unbalanced ()"
    ]
    assert expression_problems(
        "histogram_quantile(99, sum by (le) (rate(guardrail_probe_duration_seconds_bucket[5m])))",
        exported,
    ) == ["quantile 99 outside (0, 1)"]
    assert expression_problems("up", exported) == ["names no guardrail metric"]
    assert (
        expression_problems('rate(guardrail_probe_score_bucket{signal="focus"}[5m])', exported)
        == []
    )
    assert expression_problems("rate(guardrail_probe_focus_score_bucket[5m])", exported) == [
        "guardrail_probe_focus_score_bucket is not exported"  # the name before signals
    ]


def test_dashboard_matches_the_schema():
    jsonschema.validate(dashboard(), DASHBOARD_SCHEMA)


def test_dashboard_variables_select_datasource_and_model(exported):
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["multi"] and model["includeAll"]
    match = re.fullmatch(r"label_values\((guardrail_\w+), model_name\)", model["definition"])
    assert match and "model_name" in exported[match.group(1)]
    assert model["query"]["query"] == model["definition"]


def test_every_dashboard_expression_names_exported_metrics_for_the_chosen_model(exported):
    for where, expr in dashboard_exprs():
        assert expression_problems(expr, exported) == [], where
        for name, matchers in SELECTOR.findall(expr):
            if "model_name" in exported[name]:
                assert 'model_name=~"$model_name"' in matchers, f"{where}: {name} not filtered"


def test_dashboard_panels_cover_the_issue_and_every_metric(exported):
    exprs = " ".join(expr for _, expr in dashboard_exprs())
    required = [
        r"sum by \(action\) \(rate\(guardrail_requests_total",  # decisions by action
        r'action="block"\}\[\$__rate_interval\]\)\) / sum\(rate\(guardrail_requests_total',
        r"histogram_quantile\(0\.5, sum by \(le\) \(rate\(guardrail_probe_score_bucket"
        r'\{[^}]*signal="focus"',
        r'increase\(guardrail_probe_score_bucket\{[^}]*signal="focus"',  # focus heatmap
        *(
            rf"histogram_quantile\({q}, sum by \(le\) \(rate\(guardrail_probe_duration_seconds"
            for q in ("0.5", "0.95", "0.99")
        ),
        r"guardrail_retried_requests_total",
        r"guardrail_probe_errors_total",
        r"guardrail_failure_decisions_total",
        r"guardrail_policy_threshold",
    ]
    for pattern in required:
        assert re.search(pattern, exprs), pattern
    on_dashboard = {name for name, _ in SELECTOR.findall(exprs)}
    families = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in exported}
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in on_dashboard}
    assert families == shown


def test_score_expressions_pick_one_signal():
    """Scores of different signals share one histogram: summing them by ``le`` mixes scales."""
    exprs = [expr for _, expr in dashboard_exprs()] + [r["expr"] for r in alert_rules()]
    selectors = [
        matchers
        for expr in exprs
        for name, matchers in SELECTOR.findall(expr)
        if name.startswith("guardrail_probe_score")
    ]
    assert selectors, "no panel shows the probe scores"
    for matchers in selectors:
        assert re.search(r'\bsignal="\w+"', matchers), matchers


def test_dashboard_panels_have_unique_ids_and_do_not_overlap():
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_alert_rules_are_well_formed(exported):
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"Guardrail[A-Z][A-Za-z]+", rule["alert"])
        assert re.fullmatch(r"\d+[smhd]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"])
        assert expression_problems(rule["expr"], exported) == [], rule["alert"]


def test_alerts_cover_block_spikes_errors_fail_open_and_latency():
    exprs = {r["alert"]: r["expr"] for r in alert_rules()}
    assert 'guardrail_requests_total{action="block"}' in exprs["GuardrailBlockRatioSpike"]
    assert "guardrail_probe_errors_total" in exprs["GuardrailProbeErrors"]
    assert 'mode="fail_open", shadow="false"' in exprs["GuardrailFailOpenDecisions"]
    assert "guardrail_probe_duration_seconds_bucket" in exprs["GuardrailProbeLatencyHigh"]
    assert "guardrail_config_calibrated == 0" in exprs["GuardrailConfigUncalibrated"]


def promtool(*args: str) -> str:
    assert PROMTOOL is not None
    run = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@needs_promtool
def test_promtool_parses_the_alert_rules():
    assert "SUCCESS: 6 rules found" in promtool("check", "rules", str(ALERTS))


@needs_promtool
def test_promtool_parses_every_dashboard_expression(tmp_path):
    rules = [
        {
            "record": f"dashboard:expr_{i}",
            "expr": expr.replace("$__rate_interval", "5m").replace("$model_name", ".*"),
        }
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", str(path))


def alert_test(
    series: dict[str, str],
    alert: str,
    fires_at: str,
    quiet_at: str,
    labels: dict[str, str],
    annotations: dict[str, str],
) -> dict[str, Any]:
    """One promtool unit test: ``alert`` is silent at ``quiet_at`` and firing at ``fires_at``."""
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [
            {"eval_time": quiet_at, "alertname": alert, "exp_alerts": []},
            {
                "eval_time": fires_at,
                "alertname": alert,
                "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
            },
        ],
    }


@needs_promtool
def test_alerts_fire_on_synthetic_series(tmp_path):
    requests = 'guardrail_requests_total{model_name="m", action="%s"}'
    duration = 'guardrail_probe_duration_seconds_bucket{model_name="m", le="%s"}'
    fail_open = (
        'guardrail_failure_decisions_total{model_name="m", policy="p", '
        'mode="fail_open", shadow="false"}'
    )
    tests = [
        alert_test(
            {requests % "allow": "0+60x1560", requests % "block": "0+1x1440 1440+30x120"},
            "GuardrailBlockRatioSpike",
            fires_at="1d40m",
            quiet_at="1d",
            labels={"severity": "warning", "model_name": "m"},
            annotations={
                "summary": "Guardrail block ratio spiked on m",
                "description": "33.33% of requests to m were blocked over the last 10 "
                "minutes, more than 3x the 1-day baseline. Either a prompt injection "
                "campaign is under way or a policy threshold changed: compare the focus "
                "score panel with guardrail_policy_threshold.",
            },
        ),
        alert_test(
            {
                requests % "allow": "0+10x40",
                'guardrail_probe_errors_total{model_name="m", reason="layer"}': "0x10 0+1x30",
            },
            "GuardrailProbeErrors",
            fires_at="30m",
            quiet_at="15m",
            labels={"severity": "warning", "model_name": "m"},
            annotations={
                "summary": "Guardrail probe failing on m",
                "description": "10% of requests to m were not scored by the probe over 5 "
                "minutes; their policies' failure modes decided instead (fail-closed "
                "blocks them). guardrail_probe_errors_total{reason} says where it fails.",
            },
        ),
        alert_test(
            {fail_open: "0x5 1x10"},
            "GuardrailFailOpenDecisions",
            fires_at="7m",
            quiet_at="5m",
            labels={"severity": "critical", "model_name": "m", "policy": "p"},
            annotations={
                "summary": "Unguarded requests: policy p failed open",
                "description": "Policy p on m allowed about 1 request(s) in 5 minutes "
                "that the probe could not score. Check guardrail_probe_errors_total and "
                "the engine logs.",
            },
        ),
        alert_test(
            {
                duration % "0.01": "0x60",
                duration % "0.25": "0x60",
                duration % "0.5": "0+10x60",
                duration % "+Inf": "0+10x60",
            },
            "GuardrailProbeLatencyHigh",
            fires_at="30m",
            quiet_at="10m",
            labels={"severity": "warning", "model_name": "m"},
            annotations={
                "summary": "Guardrail probe slow on m",
                "description": "The probe's p99 time is 497.5ms on m. Long prompts read "
                "many keys back from the prefix cache; check the prompt lengths and the "
                "number of probed heads.",
            },
        ),
        alert_test(
            {'guardrail_config_calibrated{model_name="m"}': "1x10 0x10"},
            "GuardrailConfigUncalibrated",
            fires_at="18m",
            quiet_at="10m",
            labels={"severity": "warning", "model_name": "m"},
            annotations={
                "summary": "Guardrail config of m was never calibrated",
                "description": "The probe config guarding m records no calibration (published "
                "heads, untuned threshold): its block and flag decisions are not measured on "
                "this model. Run `guardrail calibrate --model MODEL --out DIR` and "
                "serve with the config it writes.",
            },
        ),
    ]
    path = tmp_path / "alerts_test.yml"
    path.write_text(
        yaml.safe_dump(
            {"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests}, width=1000
        )
    )
    assert "SUCCESS" in promtool("test", "rules", str(path))


@needs_promtool
def test_promtool_accepts_the_replica_scrape_config() -> None:
    config = ROOT / "monitoring" / "prometheus-replicas.yml"
    assert "SUCCESS" in promtool("check", "config", "--syntax-only", str(config))
