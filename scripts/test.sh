#!/usr/bin/env bash
# Set-up, then the whole test suite. Extra arguments go to pytest.
#
# The suite runs in PTDP_TEST_WORKERS processes (default 2), each taking
# whole test files (pytest-xdist, --dist loadfile, so a file's fixtures are
# made once): many tests run one process on one core, and two keep a 2-core
# machine busy (17 min instead of 20.5 min there). xdist hands out the files
# with the most tests first, which happens to pair the long multi-process
# files with quick in-process ones; the slowest files first was slower (two
# multi-process jobs at once oversubscribe the cores). PTDP_TEST_WORKERS=0
# runs the suite in this process alone.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${PTDP_TEST_WORKERS:-2}" --dist loadfile "$@"
