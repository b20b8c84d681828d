#!/usr/bin/env bash
# Create .venv and install swarmtrain with its test extra. torch 2.13.0 first: it is the CPU build
# on this machine's disk; any other resolution would download gigabytes of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
