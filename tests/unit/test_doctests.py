"""Every docstring example in the installed package runs and prints what it shows.

Modules are imported by their installed names (``guardrail.integrations``, not the source
folder ``integrations``), so the examples see the same classes users do. Examples that need a
running engine are marked ``+SKIP`` in place.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

PACKAGES = ("guardrail", "guardrail.integrations", "guardrail.policies")
NEEDS = {"guardrail.probe._fused_kernel": "triton"}
"""Modules that import an optional dependency at the top (the GPU build's Triton)."""


def _modules() -> list[str]:
    names = set(PACKAGES)
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names |= {m.name for m in pkgutil.walk_packages(path, package + ".")}
    return sorted(n for n in names if not n.startswith("guardrail.model_configs"))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name, capsys):
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"{name} needs {NEEDS[name]}, not installed here")
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=True)
    assert result.failed == 0, capsys.readouterr().out
