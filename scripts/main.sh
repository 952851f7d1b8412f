#!/usr/bin/env bash
# The README's main job: set up, build the Hub kernels, load them with get_kernel,
# run a tiny MoE model with and without our experts kernel, run the batch-size sweep.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/env.sh
python scripts/main_job.py "$@"
