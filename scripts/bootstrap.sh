#!/usr/bin/env bash
# Set up a checkout's .venv with everything tfdist needs; quick (under a second) when already set up.
#
#   bash scripts/bootstrap.sh                 # .venv, the pinned stack, Horovod (built once, cached)
#   bash scripts/bootstrap.sh --with-mpi      # also Open MPI: Horovod is then built with MPI too
#   bash scripts/bootstrap.sh --for-tests     # every system package the test suite uses (run_tests.sh)
#   bash scripts/bootstrap.sh --dry-run ...   # say which system packages it would install and why
#
# System packages come from apt, need root, and are installed only where missing: the build tools
# (python3.11, g++, cmake, make) always; the rest only when asked, by option or by
# TFDIST_SYSTEM_PACKAGES (comma-separated groups, or "all"):
#   mpi      --with-mpi      openmpi-bin libopenmpi-dev: Horovod with MPI (mpirun jobs, Adasum)
#   slurm    --with-slurm    slurm-wlm munge: a one-node Slurm cluster for the sbatch/srun tests
#   browser  --with-browser  chromium: the test that opens TensorBoard's pages (optional)
#   net      --with-net      iproute2: network-namespace hosts (launch test, emulated links)
#   tests    --for-tests     all four
# Without root (or apt), bootstrap says what it skipped and carries on.
#
# The TensorFlow stack: the GPU one (tensorflow[and-cuda]: CUDA 12 and NCCL wheels; Horovod is then
# built with NCCL too, docs/GPU.md) where `nvidia-smi -L` lists a GPU or TFDIST_GPU=1; otherwise,
# or with TFDIST_GPU=0, the CPU one (tensorflow-cpu). CI has no GPU: it gets the CPU stack.
#
# Horovod is built and installed by tfdist/horovod_build/install.py (`tfdist-install-horovod`, the
# command pip users run), which caches the wheel in $TFDIST_CACHE (default ~/.cache/tfdist).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TFDIST_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
TF_VERSION=2.21.0
HOROVOD_VERSION=0.28.1
STAMP=$VENV/.tfdist-stamp
GROUPS_ALL=(mpi slurm browser net)

log() { echo "[bootstrap] $*" >&2; }
die() { log "error: $*"; exit 2; }
# pip, minus the notes this machine's extra local indexes print for every package.
pip_quiet() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

declare -A ASKED=()  # group -> who asked for it
ask() {
  case $1 in
    "") ;;
    all|tests) for g in "${GROUPS_ALL[@]}"; do ask "$g" "$2"; done ;;
    mpi|slurm|browser|net) [ -n "${ASKED[$1]:-}" ] || ASKED[$1]=$2 ;;
    *) die "unknown system package group '$1' (from $2): expected mpi, slurm, browser, net, tests or all" ;;
  esac
}
IFS=', ' read -ra from_env <<<"${TFDIST_SYSTEM_PACKAGES:-}"
for g in "${from_env[@]}"; do ask "$g" "TFDIST_SYSTEM_PACKAGES"; done
DRY_RUN=0
for arg in "$@"; do
  case $arg in
    --with-mpi|--with-slurm|--with-browser|--with-net) ask "${arg#--with-}" "$arg" ;;
    --for-tests) ask tests "--for-tests: the test suite uses it" ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$arg' (see: bash scripts/bootstrap.sh --help)" ;;
  esac
done

packages_of() {
  case $1 in
    mpi) echo openmpi-bin libopenmpi-dev ;; slurm) echo slurm-wlm munge ;;
    browser) echo chromium ;; net) echo iproute2 ;;
  esac
}
use_of() {
  case $1 in
    mpi) echo "Horovod with MPI too: mpirun jobs, Adasum" ;;
    slurm) echo "a one-node Slurm cluster for the sbatch/srun tests" ;;
    browser) echo "the TensorBoard browser test" ;;
    net) echo "network-namespace hosts: launch test, emulated links" ;;
  esac
}
# 0 (yes) for the GPU stack: TFDIST_GPU=1, or unset and nvidia-smi lists a GPU.
gpu_stack() {
  case ${TFDIST_GPU:-} in
    1) return 0 ;;
    0) return 1 ;;
    "") command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU ' ;;
    *) die "TFDIST_GPU=$TFDIST_GPU: expected 1 (GPU stack), 0 (CPU stack) or unset (GPU stack if nvidia-smi lists a GPU)" ;;
  esac
}
stack_reason() {
  case ${TFDIST_GPU:-} in
    1) echo "GPU (tensorflow[and-cuda], Horovod with NCCL): TFDIST_GPU=1" ;;
    0) echo "CPU (tensorflow-cpu): TFDIST_GPU=0" ;;
    *) if gpu_stack; then echo "GPU (tensorflow[and-cuda], Horovod with NCCL): nvidia-smi lists a GPU"
       else echo "CPU (tensorflow-cpu): no GPU listed by nvidia-smi (TFDIST_GPU=1 to insist)"; fi ;;
  esac
}
STACK=cpu
gpu_stack && STACK=gpu
present() {
  case $1 in
    mpi) command -v mpicxx >/dev/null ;;
    slurm) command -v slurmd >/dev/null ;;
    browser) command -v chromium >/dev/null || command -v chromium-browser >/dev/null ;;
    net) command -v ip >/dev/null && command -v tc >/dev/null ;;
  esac
}
CAN_INSTALL=0
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && CAN_INSTALL=1
missing=()  # asked for and not on this machine
for g in "${GROUPS_ALL[@]}"; do
  if [ -n "${ASKED[$g]:-}" ] && ! present "$g"; then missing+=("$g"); fi
done
# The stamp's first line records what was installed: a change to these files, or MPI appearing,
# re-runs the install. Its second line, the groups asked for so far: a group asked for the first
# time re-runs it too (one that could not be installed then is not retried on every run).
want() {
  local mpi=gloo-only
  command -v mpicxx >/dev/null && mpi=mpi
  local sources=("$ROOT/setup.cfg" "$0" "$ROOT/tfdist/horovod_build/install.py" "$ROOT/tfdist/horovod_build/toolchain.py"
                 "$ROOT"/tfdist/horovod_build/patches/*.patch)
  echo "tf=$TF_VERSION-$STACK hvd=$HOROVOD_VERSION $mpi $(cat "${sources[@]}" | sha1sum | cut -c1-12)"
}
asked_before=$( [ -f "$STAMP" ] && sed -n 2p "$STAMP" || true)
new_asks=()
for g in "${missing[@]}"; do
  [[ " $asked_before " == *" $g "* ]] || new_asks+=("$g")
done
if [ "$DRY_RUN" = 0 ] && [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP")" = "$(want)" ] && [ ${#new_asks[@]} -eq 0 ]; then
  [ ${#missing[@]} -eq 0 ] || log "still without ${missing[*]} (asked for; not installable here earlier)"
  exit 0
fi

# --- system packages ---------------------------------------------------------------------------
build_pkgs=()
command -v "$PYTHON" >/dev/null || build_pkgs+=(python3 python3-venv python3-dev)
command -v g++ >/dev/null || build_pkgs+=(g++)
command -v cmake >/dev/null || build_pkgs+=(cmake)
command -v make >/dev/null || build_pkgs+=(make)
apt_pkgs=("${build_pkgs[@]}")
[ ${#build_pkgs[@]} -eq 0 ] || log "system packages for Python and the Horovod build: ${build_pkgs[*]}"
for g in "${missing[@]}"; do
  log "system packages for $g ($(packages_of "$g"); $(use_of "$g")), asked by ${ASKED[$g]}"
  [ "$g" = browser ] || apt_pkgs+=($(packages_of "$g"))
done
for g in "${GROUPS_ALL[@]}"; do
  if [ -z "${ASKED[$g]:-}" ] && ! present "$g"; then
    log "not installing $g ($(packages_of "$g")): not asked (--with-$g)"
  fi
done
if [ "$DRY_RUN" = 1 ]; then
  log "TensorFlow stack: $(stack_reason)"
  for g in "${GROUPS_ALL[@]}"; do
    if [ -n "${ASKED[$g]:-}" ] && present "$g"; then log "$g: already installed (asked by ${ASKED[$g]})"; fi
  done
  [ ${#apt_pkgs[@]} -gt 0 ] || [[ " ${missing[*]} " == *" browser "* ]] || log "no system packages to install"
  [ "$CAN_INSTALL" = 1 ] || log "not root (or no apt-get): would skip them"
  exit 0
fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$CAN_INSTALL" = 1 ]; then
    log "installing ${apt_pkgs[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
    command -v "$PYTHON" >/dev/null || PYTHON=python3
  else
    log "not root (or no apt-get): skipped ${apt_pkgs[*]};" \
      "install them yourself (sudo apt-get install ${apt_pkgs[*]}) for what they are for (above)"
    command -v "$PYTHON" >/dev/null || PYTHON=python3
  fi
fi
# Chromium is optional: where it cannot be installed, the browser test skips and says why.
if [[ " ${missing[*]} " == *" browser "* ]]; then
  if [ "$CAN_INSTALL" = 1 ] && apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then
    :
  else
    log "chromium not installed: the TensorBoard browser test will skip"
  fi
fi

# --- Python environment ------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
pip_quiet install -q --upgrade pip wheel 'setuptools<81' packaging

log "TensorFlow stack: $(stack_reason)"
if [ "$STACK" = gpu ]; then TF_REQ="tensorflow[and-cuda]==$TF_VERSION"; TF_OTHER=tensorflow-cpu; HVD_GPU=yes
else TF_REQ="tensorflow-cpu==$TF_VERSION"; TF_OTHER=tensorflow; HVD_GPU=no; fi
# Both distributions install the same `tensorflow` package: drop the other stack's first.
if "$PY" -m pip show -q "$TF_OTHER" >/dev/null 2>&1; then pip_quiet uninstall -y -q "$TF_OTHER"; fi
log "installing $TF_REQ, tf-keras, test tools"
pip_quiet install -q "$TF_REQ" "tf-keras==$TF_VERSION" tensorboard \
  numpy pytest pytest-xdist scikit-learn matplotlib cloudpickle psutil py-spy pyyaml "tensorboard-plugin-profile==2.24.2" \
  "keras-hub==0.32.0" mock  # mock: Horovod's own suite (tests/test_horovod_suite.py)
# TensorFlow Recommenders (tests/test_model_options.py, tfdist-benchmark --model tfrs_retrieval): without
# its dependencies, whose `tensorflow` would add the full TensorFlow beside tensorflow-cpu.
pip_quiet install -q --no-deps "tensorflow-recommenders==0.7.7"
pip_quiet install -q --no-deps -e "$ROOT"
# The docs site's tools, as pinned in setup.cfg's `docs` extra (tests/test_docs_site.py builds it).
mapfile -t DOCS_REQ < <("$PY" -c 'import configparser, sys; c = configparser.ConfigParser(); c.read(sys.argv[1])
print(c["options.extras_require"]["docs"].strip())' "$ROOT/setup.cfg")
log "installing the docs tools (setup.cfg's docs extra): ${DOCS_REQ[*]}"
pip_quiet install -q "${DOCS_REQ[@]}"
# Ray Train, as pinned in setup.cfg's `ray` extra (tests/test_ray_train.py runs real Ray jobs).
mapfile -t RAY_REQ < <("$PY" -c 'import configparser, sys; c = configparser.ConfigParser(); c.read(sys.argv[1])
print(c["options.extras_require"]["ray"].strip())' "$ROOT/setup.cfg")
log "installing Ray Train (setup.cfg's ray extra): ${RAY_REQ[*]}"
pip_quiet install -q "${RAY_REQ[@]}"

# Horovod: the cached wheel, else built once (the same code as `tfdist-install-horovod`).
# (--gpu: NCCL with the GPU stack, never with the CPU one, even where CUDA wheels are left over.)
"$PY" -m tfdist.horovod_build.install --gpu "$HVD_GPU"
asked_now=$(printf '%s\n' $asked_before "${!ASKED[@]}" | sort -u | tr '\n' ' ')
printf '%s\n%s\n' "$(want)" "${asked_now% }" > "$STAMP"
log "ready: $VENV"
