#!/usr/bin/env bash
# The prepared GPU check (< 8 min on one H200): GPU tests, FlexAttention mask, bf16 drafter training steps at
# Qwen3-8B shape, and the cost model at Qwen3-8B / Qwen3-4B shapes. Writes docs/gpu_check.{json,md}.
# Usage: bash scripts/gpu_check.sh [--small]      (--small: tiny shapes, runs on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
# dflash.generate, not dflash: PyPI's `dflash` (another project) has the same import name
python -c "import dflash.generate" 2>/dev/null || python -m pip install -q -e ".[torch,test]"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python -m dflash.bench gpu-check "$@"
