#!/usr/bin/env bash
# Set-up, then the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
