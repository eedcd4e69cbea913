#!/usr/bin/env bash
# Set up (once) and run the whole test suite: ruff (lint + format), mypy, the import-layering
# contracts (lint-imports, [tool.importlinter] in pyproject.toml), pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check guardrail integrations policies tests examples benchmarks monitoring
.venv/bin/ruff format --check guardrail integrations policies tests examples benchmarks monitoring
.venv/bin/mypy
# The grimp cache goes under .venv/ (git-ignored), not ./.import_linter_cache.
.venv/bin/lint-imports --no-logo --cache-dir .venv/.import_linter_cache
exec .venv/bin/python -m pytest "$@"
