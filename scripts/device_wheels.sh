#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that a bare GPU machine lacks for the device check
# (scripts/device_check.sh), for its Python, into a git-ignored folder that travels with the working tree.
#
#   bash scripts/device_wheels.sh [--python 3.12] [--dest .whl]
#
# The GPU image this project is checked on (docs/gpu.md) has Python 3.12, torch with CUDA, transformers, h5py,
# mpi4py, tensorboard, pytest and hypothesis, but not omegaconf, submitit or megatron-core: those are the bundle
# (about 3 MiB). Nothing here is torch: the device's own build is used. The bundle must stay under the 64 MiB a
# lease carries; this script refuses a larger one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=3.12
DEST=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYVER="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "device_wheels.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# one version of each (two stop the install), pinned to what this project is tested with
WHEELS=(omegaconf==2.4.0 submitit==1.5.4 megatron-core==0.16.1)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done
PIP="${PIP:-python3 -m pip}"
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
echo "$PYVER" > "$DEST/PYTHON"  # device_check.sh installs the bundle only into this Python version
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
grep -qxF "/$DEST/" .git/info/exclude 2>/dev/null || { [ -d .git ] && echo "/$DEST/" >> .git/info/exclude; } || true
SIZE=$(du -sk "$DEST" | cut -f1)
if [ "$SIZE" -gt $((60 * 1024)) ]; then
  echo "device_wheels.sh: the bundle is ${SIZE} KiB, over the 60 MiB kept for it (a lease carries 64 MiB)" >&2
  exit 1
fi
ls -1 "$DEST"
echo "device_wheels.sh: $(ls "$DEST"/*.whl | wc -l) wheels, ${SIZE} KiB in $DEST (Python $PYVER)"
