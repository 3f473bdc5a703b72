#!/usr/bin/env bash
# The device check on a bare GPU machine (or, with --cpu, its rehearsal here): install the wheels that travel with
# the tree (scripts/device_wheels.sh made them), then run scripts/device_check.py, which writes summary.json,
# report.txt, check.log and pytest.xml under --out.
#
#   bash scripts/device_check.sh --out "$OUT"              # on the GPU machine: within 9 minutes
#   bash scripts/device_check.sh --cpu --out /tmp/check    # the CPU rehearsal (tests/test_device_check.py)
#   bash scripts/device_check.sh --install-only            # install the bundle, print the folder, stop
#
# The wheels (made for one Python version, named in .whl/PYTHON; another Python skips them) go into a target folder on PYTHONPATH (nothing of the machine's own Python changes), and the project
# is used from this checkout (PYTHONPATH), not installed. Other arguments go to device_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${HPCRL_WHEELS:-.whl}"
HAVE=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if ls "$WHEELS"/*.whl >/dev/null 2>&1 && [ "$(cat "$WHEELS/PYTHON" 2>/dev/null)" = "$HAVE" ]; then
  SITE="${HPCRL_WHEEL_SITE:-/tmp/hpcrl-wheels}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "device_check.sh: $(ls "$WHEELS"/*.whl | wc -l) wheels installed into $SITE" >&2
fi
if [ "${1:-}" = "--install-only" ]; then
  echo "${SITE:-}"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" scripts/device_check.py "$@"
