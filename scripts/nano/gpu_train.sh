#!/usr/bin/env bash
# The device-machine command that trains the nano model (one H200 call; see scripts/nano/README.md).
# Needs the corpus in .nano/corpus and FLA in .nano/fla.tgz (carry .nano). Extra arguments go to train_model.py.
# Env: PY (python), OUT (output dir), BUDGET (training seconds), SKIP_FLA=1 to run the torch fallback of GDN.
set -u
PY=${PY:-python3}
OUT=${OUT:-.nano/gpu_out}
BUDGET=${BUDGET:-140}
mkdir -p /tmp/site "$OUT"
if [ "${SKIP_FLA:-0}" != 1 ] && [ -f .nano/fla.tgz ]; then tar xzf .nano/fla.tgz -C /tmp/site; fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
$PY -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla not importable: GDN uses the torch fallback"
set -o pipefail
if ! $PY scripts/nano/train_model.py --data .nano/corpus --out "$OUT/run" --time-budget "$BUDGET" "$@" 2>&1 \
        | tee "$OUT/train.log"; then
    echo "training with FLA failed; retrying with the torch fallback of GDN for $((BUDGET * 2 / 3)) s"
    PYTHONPATH=$PWD $PY scripts/nano/train_model.py --data .nano/corpus --out "$OUT/run_fallback" \
        --time-budget $((BUDGET * 2 / 3)) "$@" 2>&1 | tee "$OUT/train_fallback.log"
fi
