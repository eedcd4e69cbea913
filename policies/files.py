"""Policies from a file: the same policy objects the Python API builds, in JSON or YAML.

A file holds the default policy set and, optionally, named sets a request may pick instead
(``guardrail-serve``: the header ``x-guardrail-policies: NAME``)::

    policies:                       # the default set
      - TIERED                      # a ready-made policy or set of guardrail.policies, by name
      - {name: shadow_strict, shadow: true, threshold_offset: 0.1}
    overrides:                      # optional named sets
      untrusted_tenant: [STRICT_BLOCK, FORGED_TURNS]

An entry is a policy (an object with the fields of ``PromptInjectionPolicy`` or, with ``kind:
data_pattern``, ``DataPatternPolicy``) or a ready-made name. A bare list is the default set.
Everything is validated by the same code as policies given in Python (``load_policies``: names
distinct, thresholds resolvable on the served model); a bad file is a ``ConfigError`` naming the
file, the set and the entry, never a guard that allows everything. ``policy_file_schema()`` is
the JSON schema of the format (docs/policies.schema.json).

Example:
    >>> sets = load_policy_text('{"policies": ["TIERED"]}', model_threshold=0.5)
    >>> [p.name for p in sets.default]
    ['block_injections', 'suspicious']
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from guardrail.policies import prompt_injection as ready
from pydantic import BaseModel, ConfigDict, Field

from guardrail.errors import ConfigError
from guardrail.policy import DataPatternPolicy, Policy, PromptInjectionPolicy, load_policies
from guardrail.policy.kinds import ModelThreshold, load_policy

__all__ = ["PRESETS", "PolicySets", "load_policy_file", "load_policy_text", "policy_file_schema"]

PRESETS: dict[str, tuple[Policy, ...]] = {
    "BLOCK_INJECTIONS": (ready.BLOCK_INJECTIONS,),
    "FLAG_INJECTIONS": (ready.FLAG_INJECTIONS,),
    "MONITOR_ONLY": (ready.MONITOR_ONLY,),
    "SHADOW_BLOCK": (ready.SHADOW_BLOCK,),
    "STRICT_BLOCK": (ready.STRICT_BLOCK,),
    "SUSPICIOUS": (ready.SUSPICIOUS,),
    "RETRY_STEERED": (ready.RETRY_STEERED,),
    "FORGED_TURNS": (ready.FORGED_TURNS,),
    "DEFAULT": ready.DEFAULT,
    "TIERED": ready.TIERED,
    "TRIAL": ready.TRIAL,
}
"""The ready-made policies and sets a file may name (``guardrail.policies``)."""

PresetName = Literal[
    "BLOCK_INJECTIONS",
    "FLAG_INJECTIONS",
    "MONITOR_ONLY",
    "SHADOW_BLOCK",
    "STRICT_BLOCK",
    "SUSPICIOUS",
    "RETRY_STEERED",
    "FORGED_TURNS",
    "DEFAULT",
    "TIERED",
    "TRIAL",
]
Entry = PromptInjectionPolicy | DataPatternPolicy | PresetName


class PolicyFile(BaseModel):
    """The file format (its JSON schema is ``policy_file_schema()``)."""

    model_config = ConfigDict(extra="forbid", title="vllm-guardrail policies")

    policies: list[Entry] = Field(min_length=1, description="the default policy set")
    overrides: dict[str, list[Entry]] = Field(
        default_factory=dict,
        description="named sets a request may pick instead (guardrail-serve: the header "
        "x-guardrail-policies: NAME)",
    )


@dataclass(frozen=True)
class PolicySets:
    """A loaded file: the default set, and the named override sets."""

    default: tuple[Policy, ...]
    overrides: dict[str, tuple[Policy, ...]] = field(default_factory=dict)


def policy_file_schema() -> dict[str, Any]:
    """The JSON schema of a policies file.

    Example:
        >>> sorted(policy_file_schema()["properties"])
        ['overrides', 'policies']
    """
    return PolicyFile.model_json_schema()


def _entries(raw: Any, where: str, model_threshold: ModelThreshold) -> tuple[Policy, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of policies, got {type(raw).__name__}")
    loaded: list[Policy] = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            if entry not in PRESETS:
                raise ConfigError(
                    f"{where}[{i}]: {entry!r} is no ready-made policy; known: {sorted(PRESETS)}"
                )
            loaded.extend(PRESETS[entry])
            continue
        try:
            loaded.append(load_policy(entry))
        except ConfigError as exc:
            raise ConfigError(f"{where}[{i}]: {exc}") from exc
    try:
        return load_policies(loaded, model_threshold)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_policy_text(
    text: str, model_threshold: ModelThreshold, *, yaml: bool = False, source: str = "policies"
) -> PolicySets:
    """Policy sets from the text of a file (JSON, or YAML with ``yaml=True``)."""
    try:
        if yaml:
            import yaml as pyyaml

            data = pyyaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        kind = "YAML" if yaml else "JSON"
        raise ConfigError(f"{source}: not valid {kind}: {exc}") from exc
    if isinstance(data, list):
        data = {"policies": data}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected an object with 'policies' (or a list of policies)")
    unknown = sorted(set(data) - set(PolicyFile.model_fields))
    if unknown:
        raise ConfigError(f"{source}: unknown keys {unknown}; a file has 'policies', 'overrides'")
    if "policies" not in data:
        raise ConfigError(f"{source}: no 'policies': a guard without policies allows everything")
    default = _entries(data["policies"], f"{source}: policies", model_threshold)
    overrides_raw = data.get("overrides") or {}
    if not isinstance(overrides_raw, dict):
        raise ConfigError(f"{source}: 'overrides' must map a name to a list of policies")
    overrides = {
        str(name): _entries(entries, f"{source}: overrides.{name}", model_threshold)
        for name, entries in overrides_raw.items()
    }
    return PolicySets(default, overrides)


def load_policy_file(path: str | Path, model_threshold: ModelThreshold) -> PolicySets:
    """Policy sets from a JSON or YAML file (``.yaml`` / ``.yml``: YAML)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the policies file {path}: {exc.strerror}") from exc
    yaml = path.suffix.lower() in (".yaml", ".yml")
    return load_policy_text(text, model_threshold, yaml=yaml, source=str(path))
