#!/usr/bin/env bash
# The whole test suite: install (idempotent), lint, then unit, integration and NAT-lab tests.
# NAT-lab tests need root; without it they skip (and fail under CI=true), as the dashboard's
# Chromium test does without chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && ! command -v nft >/dev/null; then
  echo "installing nftables for the NAT lab" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables >/dev/null
fi
if [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null; then
  echo "installing chromium for the dashboard's browser test" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
