#!/usr/bin/env bash
# Set up everything tfdist needs on a fresh machine; quick (seconds) when already set up.
#
#   bash scripts/bootstrap.sh        # creates .venv, installs the pinned stack, builds Horovod once
#
# The Horovod wheel is built from its PyPI sdist against the installed TensorFlow and cached in
# $TFDIST_CACHE (default ~/.cache/tfdist), keyed by Horovod + TensorFlow + Python versions.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TFDIST_VENV:-$ROOT/.venv}
CACHE=${TFDIST_CACHE:-$HOME/.cache/tfdist}
PYTHON=${PYTHON:-python3.11}
TF_VERSION=2.21.0
HOROVOD_VERSION=0.28.1
STAMP=$VENV/.tfdist-stamp
# The stamp records what was installed; a change to this file or setup.cfg re-runs the install.
WANT="tf=$TF_VERSION hvd=$HOROVOD_VERSION $(cat "$ROOT/setup.cfg" "$0" | sha1sum | cut -c1-12)"

log() { echo "[bootstrap] $*" >&2; }
# pip, minus the notes this machine's extra local indexes print for every package.
pip_quiet() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

need_apt=()
command -v "$PYTHON" >/dev/null || need_apt+=(python3 python3-venv python3-dev)
command -v g++ >/dev/null || need_apt+=(g++)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v make >/dev/null || need_apt+=(make)
command -v ip >/dev/null || need_apt+=(iproute2)  # network-namespace hosts (launch test, emulated links)
command -v tc >/dev/null || need_apt+=(iproute2)
# Open MPI: Horovod is built with MPI as well as Gloo, for mpirun jobs and Adasum.
command -v mpicxx >/dev/null || need_apt+=(openmpi-bin libopenmpi-dev)
# A one-node Slurm cluster for the sbatch/srun tests (they skip with the reason where it cannot start).
command -v slurmd >/dev/null || need_apt+=(slurm-wlm munge)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing system packages: ${need_apt[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  command -v "$PYTHON" >/dev/null || PYTHON=python3
fi
# Headless Chromium for the test that opens TensorBoard's pages in a real browser. Optional: where
# it cannot be installed (no apt, no package) that test skips and says why.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if command -v apt-get >/dev/null && log "installing chromium (for the browser test)" \
      && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then
    :
  else
    log "chromium not installed: the TensorBoard browser test will skip"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
pip_quiet install -q --upgrade pip wheel 'setuptools<81' packaging

log "installing tensorflow-cpu $TF_VERSION, tf-keras, test tools"
pip_quiet install -q "tensorflow-cpu==$TF_VERSION" "tf-keras==$TF_VERSION" tensorboard \
  numpy pytest scikit-learn matplotlib cloudpickle psutil pyyaml "tensorboard-plugin-profile==2.24.2"

PYVER=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# With MPI on the machine (mpicxx), Horovod is built with MPI too, and cached apart from Gloo-only builds.
mpi_flag=HOROVOD_WITHOUT_MPI=1 mpi_suffix=
command -v mpicxx >/dev/null && mpi_flag=HOROVOD_WITH_MPI=1 mpi_suffix=-mpi
WHEEL_DIR=$CACHE/wheels/horovod-$HOROVOD_VERSION-tf$TF_VERSION-$PYVER$mpi_suffix
if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  log "building horovod $HOROVOD_VERSION against TF $TF_VERSION (one-off, ~5 min)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  pip_quiet download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
  tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  src=$work/horovod-$HOROVOD_VERSION
  # xla_mpi_ops.cc does not compile against TF 2.21 headers (XLA moved); Horovod works without it,
  # only its XLA-compiled ops are missing (tfdist detects that and says so).
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  mkdir -p "$WHEEL_DIR"
  (cd "$src" && export CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
      HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "$mpi_flag" \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      && pip_quiet wheel -q --no-build-isolation --no-deps -w "$WHEEL_DIR.tmp" . ) \
    || { log "horovod build failed (see above)"; rm -rf "$WHEEL_DIR.tmp"; exit 1; }
  mv "$WHEEL_DIR.tmp"/horovod-*.whl "$WHEEL_DIR"/ && rm -rf "$WHEEL_DIR.tmp"
fi
pip_quiet install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
pip_quiet install -q cffi cloudpickle psutil pyyaml packaging
pip_quiet install -q --no-deps -e "$ROOT"

log "checking horovod build"
check=$("$VENV/bin/horovodrun" -cb 2>/dev/null)
echo "$check" >&2
grep -q "\[X\] TensorFlow" <<<"$check" || { log "horovod lacks TensorFlow support"; exit 1; }
grep -q "\[X\] Gloo" <<<"$check" || { log "horovod lacks Gloo support"; exit 1; }
grep -q "\[X\] MPI" <<<"$check" || { log "horovod lacks MPI support (is mpicxx from libopenmpi-dev installed?)"; exit 1; }
echo "$WANT" > "$STAMP"
log "ready: $VENV"
