#!/usr/bin/env bash
# Set up (once) and run the whole test suite: ruff (lint + format), mypy, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check guardrail integrations policies tests examples benchmarks monitoring
.venv/bin/ruff format --check guardrail integrations policies tests examples benchmarks monitoring
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
