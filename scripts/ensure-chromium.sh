#!/usr/bin/env bash
# Make sure Debian's chromium is at /usr/bin/chromium for the browser tests (tests/e2e/).
#
# Idempotent: does nothing when it is already installed. Installs it with apt-get only when
# running as root; otherwise says what to run and fails. Playwright's own browser downloads are
# never used: the tests drive this system chromium.
set -euo pipefail

CHROMIUM=/usr/bin/chromium

if [[ -x "$CHROMIUM" ]]; then
    echo "ensure-chromium: $CHROMIUM already installed: $("$CHROMIUM" --version 2>/dev/null || echo 'version unknown')"
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    echo "ensure-chromium: $CHROMIUM is missing and this is not root;" \
        "install it with: sudo apt-get install -y chromium" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-chromium: $CHROMIUM is missing and apt-get is not available" >&2
    exit 1
fi

echo "ensure-chromium: installing Debian's chromium (apt-get update && apt-get install chromium)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium

if [[ ! -x "$CHROMIUM" ]]; then
    echo "ensure-chromium: apt-get finished but $CHROMIUM is still missing" >&2
    exit 1
fi
echo "ensure-chromium: installed $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
