#!/usr/bin/env bash
# Set up (once) and start the guarded OpenAI-compatible server on the embedded SmolLM2-135M-Instruct
# at http://127.0.0.1:8000/v1 (docs/serving.md). Arguments go to guardrail-serve (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/guardrail-serve "$@"
