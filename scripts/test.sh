#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite on this machine's CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/env.sh
# One style and no undefined names, before any test runs.
ruff format --check --quiet . || { echo "test.sh: run 'ruff format .'" >&2; exit 1; }
ruff check --quiet .
set +e
# One worker per core (CI has 2), a test file per worker at a time: module
# fixtures (compiled programs, built kernels) stay with their tests.
python -m pytest tests -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
