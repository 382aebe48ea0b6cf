#!/usr/bin/env bash
# Build or serve the documentation site (mkdocs.yml: the guide in docs/ and the API reference
# generated from docstrings).
#
#   bash scripts/docs.sh build [dir]      # strict build into site/ (or dir); open site/index.html
#   bash scripts/docs.sh serve [port]     # http://127.0.0.1:8000 (or port), rebuilt on every change
#   bash scripts/docs.sh screenshot       # re-take docs/images/api_horovod_strategy.png (Chromium)
#
# The build is strict: any warning (a broken link or anchor, a page missing from the nav, a
# docstring documenting a parameter the code lacks) fails it. `serve` reports the same warnings
# but keeps serving, so a page can be fixed while it is open. MkDocs and its plugins are the `docs`
# extra (`pip install -e '.[docs]'`); `bash scripts/bootstrap.sh --for-tests` puts them in .venv.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TFDIST_VENV:-$ROOT/.venv}
# Material for MkDocs prints a banner about its successor on every run: not a build warning.
export NO_MKDOCS_2_WARNING=1

die() { echo "[docs] error: $*" >&2; exit 2; }
if [ -x "$VENV/bin/mkdocs" ]; then MKDOCS=("$VENV/bin/mkdocs")
elif command -v mkdocs >/dev/null; then MKDOCS=(mkdocs)
else die "mkdocs not found: pip install -e '$ROOT[docs]' (or: bash scripts/bootstrap.sh --for-tests)"
fi

cmd=${1:-}
[ $# -eq 0 ] || shift
case $cmd in
  build)
    [ $# -le 1 ] || die "usage: bash scripts/docs.sh build [dir]"
    out=$(realpath -m "${1:-$ROOT/site}")  # a relative dir is taken from where the command runs
    cd "$ROOT"
    "${MKDOCS[@]}" build --strict --clean -f "$ROOT/mkdocs.yml" -d "$out"
    echo "[docs] built: $out/index.html" >&2
    ;;
  serve)
    [ $# -le 1 ] || die "usage: bash scripts/docs.sh serve [port]"
    port=${1:-8000}
    [[ $port =~ ^[0-9]+$ ]] || die "port '$port' is not a number"
    cd "$ROOT"
    # Docstrings live in the source: reload on edits there too.
    exec "${MKDOCS[@]}" serve --no-strict -f "$ROOT/mkdocs.yml" -a "127.0.0.1:$port" \
      -w "$ROOT/tfdist" -w "$ROOT/callbacks" -w "$ROOT/pipelines"
    ;;
  screenshot)
    [ $# -eq 0 ] || die "usage: bash scripts/docs.sh screenshot"
    chromium=$(command -v chromium || command -v chromium-browser) \
      || die "chromium not found (bash scripts/bootstrap.sh --with-browser installs it)"
    cd "$ROOT"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "${MKDOCS[@]}" build --strict -q -f "$ROOT/mkdocs.yml" -d "$tmp/site"
    mkdir -p "$ROOT/docs/images"
    # The same flags as tests/browser.py: headless, no sandbox (root in a container), no GPU.
    "$chromium" --headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run \
      --disable-extensions --disable-background-networking --hide-scrollbars --mute-audio \
      --virtual-time-budget=5000 --window-size=1400,2200 \
      --screenshot="$tmp/shot.png" "file://$tmp/site/api/strategy.html" >/dev/null 2>&1 \
      || die "chromium could not take the screenshot"
    cp "$tmp/shot.png" "$ROOT/docs/images/api_horovod_strategy.png"
    echo "[docs] wrote docs/images/api_horovod_strategy.png" >&2
    ;;
  *)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
    [ "$cmd" = -h ] || [ "$cmd" = --help ] || exit 2
    ;;
esac
