#!/usr/bin/env bash
# Set-up, then the main job: a short training run with tensor, pipeline
# (interleaved) and data parallelism (t = p = d = 2: eight local processes) on
# the shipped Shakespeare corpus with GPT-2's tokenizer (tokenized into the
# user cache on first use). Extra arguments are passed to `ptdp train` and
# override the config file.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/ptdp train --config examples/demo.yaml "$@"
