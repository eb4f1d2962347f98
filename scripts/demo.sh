#!/usr/bin/env bash
# Set-up, then the main job: a short tensor- and data-parallel training run
# (t = 2, d = 2: four local processes) on generated data. Extra arguments are
# passed to `ptdp train` and override the config file.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/ptdp train --config examples/demo.yaml "$@"
