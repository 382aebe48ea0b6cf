#!/usr/bin/env bash
# Install tfdist from a wheelhouse and train on 2 ranks where the network is really gone: a Linux
# network namespace whose only interface is loopback (no route anywhere), with a clean environment
# (no pip configuration, no index, no cache), as on a compute node without internet.
#
#   sudo bash scripts/offline_check.sh DIR [PYTHON]   # DIR from scripts/wheelhouse.py (CPU stack);
#                                                     # PYTHON: the target's interpreter (python3.11)
#   VERIFY=--no-verify sudo bash scripts/offline_check.sh DIR   # without `horovodrun -cb` (below)
#
# Needs root (ip netns) and iproute2 (bootstrap.sh --with-net). Its output is the transcript shown
# in docs/INSTALL.md ("Without network"); it exits non-zero on the first step that fails.
set -euo pipefail

[ $# -ge 1 ] && [ -d "$1" ] || { echo "usage: bash scripts/offline_check.sh WHEELHOUSE_DIR [PYTHON]" >&2; exit 2; }
DIR=$(realpath "$1")
PYTHON=$(command -v "${2:-python3.11}") || { echo "offline_check: no ${2:-python3.11} on the PATH" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "offline_check: needs root for ip netns" >&2; exit 2; }
NS=tfdist-offline-$$
WORK=$(mktemp -d /tmp/tfdist-offline.XXXXXX)
ip netns add "$NS"
trap 'ip netns delete "$NS"' EXIT
ip -n "$NS" link set lo up   # the ranks meet on 127.0.0.1; nothing else exists in the namespace

# Inside the namespace, with a compute node's bare environment: no PIP_* variables, no pip.conf.
offline() {
  ip netns exec "$NS" env -i PATH="$WORK/venv/bin:/usr/local/bin:/usr/bin:/bin" HOME="$WORK/home" \
    PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    TF_CPP_MIN_LOG_LEVEL=2 "$@"
}
step() { echo; echo "\$ $*"; }
mkdir -p "$WORK/home"

echo "offline_check: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(date -u +%F); wheelhouse $DIR" \
     "($(find "$DIR" -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1))"
step ip -n "$NS" -brief address '&&' ip -n "$NS" route
ip -n "$NS" -brief address
echo "(routes: $(ip -n "$NS" route | wc -l))"
step python -c 'socket.create_connection(("pypi.org", 443))'
offline "$PYTHON" -c '
import socket
try:
    socket.create_connection(("pypi.org", 443), timeout=10)
    raise SystemExit("offline_check: pypi.org is reachable from the namespace: not an offline test")
except OSError as e:
    print(f"no network, as intended: {e}")'

step "$PYTHON" -m venv "$WORK/venv"
offline "$PYTHON" -m venv "$WORK/venv"
step pip install --no-index --find-links "$DIR" "'tfdist[cpu]'"
SECONDS=0
offline pip install -q --no-index --find-links "$DIR" 'tfdist[cpu]'
offline python -c 'from importlib import metadata as m
print("installed in '"$SECONDS"' s:", ", ".join(f"{n} {m.version(n)}" for n in ("tfdist", "tensorflow-cpu", "keras", "tensorboard", "xprof")))'
# ${VERIFY:-}: --no-verify skips `horovodrun -cb` (three TensorFlow imports): the 2-rank run below
# checks more, and on a heavily shared machine the check alone took over 15 minutes.
step tfdist-install-horovod --wheelhouse "$DIR" ${VERIFY:-}
offline tfdist-install-horovod --wheelhouse "$DIR" ${VERIFY:-}

cat > "$WORK/train.py" <<'PY'
import tfdist, keras, numpy as np
strategy = tfdist.HorovodStrategy()
x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32"); y = (x[:, 0] > 0).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy", metrics=["accuracy"])
print(f"rank {strategy.rank}:", model.fit(x, y, batch_size=64, epochs=5, verbose=0).history["accuracy"][-1])
PY
step tfdist-run -np 2 python train.py "   # README's own-environment script"
cd "$WORK"
offline tfdist-run -np 2 python train.py
echo
echo "offline_check: installed from $DIR and trained on 2 ranks with no network ($WORK)"
