#!/usr/bin/env bash
# Debian's chromium and its chromedriver, for the run explorer's browser test (tests/test_explore_browser.py).
# Idempotent: does nothing when both are installed. Needs root and apt (the CI machine), like
# scripts/slurm_cluster.sh; nothing is downloaded at test time.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_browser.sh: chromium/chromedriver missing and not root: apt-get install chromium chromium-driver" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
echo "installed $(chromium --version 2>/dev/null) and chromedriver" >&2
