#!/usr/bin/env bash
# Set up (once) and run the main job: a guarded generation of a benign and an injected request
# on the embedded SmolLM2-135M-Instruct, printing the probe's scores and the decisions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/guarded_quickstart.py "$@"
