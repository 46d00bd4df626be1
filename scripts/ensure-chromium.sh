#!/usr/bin/env bash
# Install Debian's chromium (headless browser for tests/integration/test_report_browser.py) if it is missing.
# CI runs as root with apt; elsewhere without root this only says what to do.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "ensure-chromium: chromium is not installed; as root run: apt-get install -y --no-install-recommends chromium" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null 2>&1
echo "ensure-chromium: installed $(chromium --version 2>/dev/null || echo chromium)"
