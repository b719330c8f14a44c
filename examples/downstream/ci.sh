#!/usr/bin/env bash
# The team's CI, from a clean clone.  Installs the requirements and fpemu (FPEMU_INSTALL: what pip installs
# as fpemu, default "fpemu" from the index; a wheel's path works too; SKIP_INSTALL=1 uses what $PYTHON has),
# runs the golden tests, and fails where a test left an obtained file or changed a golden.  MATRIX=1 also
# runs the JAX loop under each jax release of matrix.toml (one pip-installed environment per release, cached:
# `fpemu env list`, `fpemu env prune`).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  "$PYTHON" -m pip install --quiet -r requirements.txt "${FPEMU_INSTALL:-fpemu}"
fi
"$PYTHON" -m pytest -q
if compgen -G "tests/golden/*.obtained.json" >/dev/null; then
  echo "ci: obtained files left in tests/golden: a test failed, or they are stale" >&2
  exit 1
fi
if git rev-parse --git-dir >/dev/null 2>&1 && [ -n "$(git status --porcelain -- tests/golden)" ]; then
  echo "ci: the tests changed the goldens:" >&2
  git status --porcelain -- tests/golden >&2
  exit 1
fi
if [ "${MATRIX:-0}" = 1 ]; then
  "$PYTHON" -m fpemu matrix matrix.toml --reports reports
fi
