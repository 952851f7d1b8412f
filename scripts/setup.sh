#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the locked requirements. Idempotent:
# a stamp of the requirements files skips pip when nothing changed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup: creating $VENV with $("$PY" --version)"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.requirements.sha256"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-nodeps.txt" | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
  echo "setup: installing locked requirements (first run takes a few minutes)"
  # torch first and alone, pinned, so nothing can pull a CUDA build in its place.
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$ROOT/requirements.txt"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$ROOT/requirements-nodeps.txt"
  echo "$WANT" > "$STAMP"
fi
