#!/usr/bin/env bash
# Set up (once) and start the guarded OpenAI-compatible server on the embedded SmolLM2-135M-Instruct
# at http://127.0.0.1:8000/v1 (docs/serving.md). Arguments go to guardrail-serve (--help): a model
# first, then its own options and vLLM's engine flags, e.g.
#   bash scripts/serve.sh DIR --probe-config my-model.json --max-model-len 4096 --port 8000
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/guardrail-serve "$@"
