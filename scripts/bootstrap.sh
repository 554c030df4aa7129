# Sourced by the run-* scripts: find Python 3.12, create .venv, install requirements-dev.txt.
# Re-running is cheap: the install is skipped while requirements-dev.txt is unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

find_python312() {
    if command -v python3.12 >/dev/null 2>&1 && python3.12 -c '' >/dev/null 2>&1; then
        command -v python3.12
        return
    fi
    # pyenv ships a python3.12 shim that fails unless 3.12 is the active version.
    local root
    root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
    for candidate in "$root"/versions/3.12*/bin/python3.12; do
        if [ -x "$candidate" ]; then
            echo "$candidate"
            return
        fi
    done
    echo "moe-release: error: Python 3.12 not found (megatron-core 0.19 requires >= 3.12)" >&2
    return 1
}

if [ ! -x "$PY" ] || ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PY312="$(find_python312)"
    echo "moe-release: creating .venv with $PY312" >&2
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV"
fi
STAMP="$VENV/.requirements-$(sha256sum "$ROOT/requirements-dev.txt" | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    echo "moe-release: installing requirements-dev.txt into .venv (torch is large; first time ~2 min)" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check -r "$ROOT/requirements-dev.txt" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    "$PY" -c 'import torch, pytest, pybind11' >/dev/null
    rm -f "$VENV"/.requirements-*
    touch "$STAMP"
fi
export NO_VCS_VERSION=1
export PYTHONDONTWRITEBYTECODE=1

# materialize_trees [--base V]: the patched tree and the pristine base (+ our new modules) under
# .build/trees (scripts/moe_release.py trees), exported as MOE_RELEASE_TREE and
# MOE_RELEASE_BASE_TREE.
materialize_trees() {
    local exports
    exports="$("$PY" "$ROOT/scripts/moe_release.py" trees "$@")" || return $?
    eval "$exports"
}
