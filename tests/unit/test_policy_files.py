"""Policies from a file are the same objects as in Python, validated the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from guardrail.policies import STRICT_BLOCK, TIERED
from guardrail.policies.files import (
    PRESETS,
    load_policy_file,
    load_policy_text,
    policy_file_schema,
)

from guardrail.errors import ConfigError
from guardrail.policy import Action, ModelThresholds, PromptInjectionPolicy, Reading, decide
from guardrail.probe.config import load_model_config

ROOT = Path(__file__).resolve().parents[2]

YAML = """
policies:
  - TIERED
  - {name: shadow_strict, shadow: true, threshold_offset: 0.1}
overrides:
  untrusted_tenant: [STRICT_BLOCK, FORGED_TURNS]
"""


def test_a_yaml_file_gives_the_python_policies(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(YAML)
    sets = load_policy_file(path, model_threshold=0.4)
    shadow = PromptInjectionPolicy(name="shadow_strict", shadow=True, threshold_offset=0.1)
    assert sets.default == (*TIERED, shadow)
    assert sets.overrides == {"untrusted_tenant": (STRICT_BLOCK, *PRESETS["FORGED_TURNS"])}
    # and they decide as the Python objects do, shadow decisions included
    for focus in (0.1, 0.42, 0.48, 0.9):
        reading = Reading(signals={"focus": focus})
        from_file = decide(sets.default, reading, request_id="r", model_threshold=0.4)
        in_python = decide((*TIERED, shadow), reading, request_id="r", model_threshold=0.4)
        assert from_file == in_python
    assert (
        decide(
            sets.default, Reading(signals={"focus": 0.48}), request_id="r", model_threshold=0.4
        ).shadow_action
        is Action.BLOCK
    )


def test_json_and_a_bare_list_load_too(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(["BLOCK_INJECTIONS", {"name": "t", "threshold": 0.3}]))
    assert [p.name for p in load_policy_file(path, 0.5).default] == ["block_injections", "t"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"policies": ["TIERD"]}', "'TIERD' is no ready-made policy"),
        ('{"policies": [{"name": "a", "treshold": 0.2}]}', "policies[0]: invalid policy 'a'"),
        ('{"policies": ["TIERED", "TIERED"]}', "policy names must be distinct"),
        ('{"policies": []}', "no policies"),
        ('{"policy": ["TIERED"]}', "unknown keys ['policy']"),
        ('{"overrides": {}}', "no 'policies'"),
        ('{"policies": ["TIERED"], "overrides": {"x": "TIERED"}}', "overrides.x: expected a list"),
        ('{"policies": [', "not valid JSON"),
    ],
)
def test_a_bad_file_is_an_error_that_names_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match="src") as raised:
        load_policy_text(text, 0.5, source="src")
    assert says in str(raised.value)


def test_a_policy_without_a_threshold_needs_a_model_threshold() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        load_policy_text('["BLOCK_INJECTIONS"]', None)


def test_the_published_schema_is_the_format() -> None:
    published = json.loads((ROOT / "docs" / "policies.schema.json").read_text())
    assert published == policy_file_schema(), "regenerate docs/policies.schema.json"
    assert set(published["properties"]) == {"policies", "overrides"}


def test_guardrail_serve_refuses_a_bad_policies_file_before_starting(tmp_path: Path) -> None:
    import subprocess
    import sys

    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"model_id": "m", "heads": [[0, 0]], "threshold": 0.5}))
    bad = tmp_path / "policies.yaml"
    bad.write_text("policies: [TIERED, {name: x, action: maybe}]\n")
    command = [sys.executable, "-m", "guardrail.integrations.serving", str(tmp_path / "model")]
    command += ["--probe-config", str(probe), "--policies", str(bad)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"guardrail-serve: {bad}: policies[1]: invalid policy 'x'" in out.stderr
    assert "action" in out.stderr and "Traceback" not in out.stderr


def test_the_example_in_docs_serving_loads() -> None:
    text = (ROOT / "docs" / "serving.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    # served: SmolLM2, whose calibrated config records the operating point a set names
    config = load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct", "combined")
    thresholds = ModelThresholds.of(config)
    sets = load_policy_text(block, thresholds, yaml=True)
    assert set(sets.overrides) == {"untrusted_tenant", "documents"} and len(sets.default) == 3
    looser = sets.overrides["documents"][0]
    assert looser.effective_threshold(thresholds) == config.threshold_at(0.02)
