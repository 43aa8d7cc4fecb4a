#!/usr/bin/env bash
# The device-machine command that trains the nano model and then its SAE set (one H200 call; see README.md here).
# Needs the corpus in .nano/corpus and FLA in .nano/fla.tgz (carry .nano). Extra arguments go to train_model.py.
# Env: PY (python), OUT (output dir), BUDGET (model training seconds), SKIP_FLA=1 (torch fallback of GDN),
#      SAES=1 (also train the SAE set on this device; it comes back as $OUT/saes.tar).
set -u
PY=${PY:-python3}
OUT=${OUT:-.nano/gpu_out}
BUDGET=${BUDGET:-140}
DEVICE=${DEVICE:-cuda}
mkdir -p /tmp/site "$OUT"
if [ "${SKIP_FLA:-0}" != 1 ] && [ -f .nano/fla.tgz ]; then tar xzf .nano/fla.tgz -C /tmp/site; fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
$PY -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla not importable: GDN uses the torch fallback"
set -o pipefail
RUN="$OUT/run"
if ! $PY scripts/nano/train_model.py --data .nano/corpus --out "$RUN" --time-budget "$BUDGET" "$@" 2>&1 \
        | tee "$OUT/train.log"; then
    echo "training with FLA failed; retrying with the torch fallback of GDN for $((BUDGET * 2 / 3)) s"
    RUN="$OUT/run_fallback"
    PYTHONPATH=$PWD $PY scripts/nano/train_model.py --data .nano/corpus --out "$RUN" \
        --time-budget $((BUDGET * 2 / 3)) "$@" 2>&1 | tee "$OUT/train_fallback.log"
fi
if [ "${SAES:-0}" = 1 ]; then
    # The SAE stage runs the model with the torch GDN path in fp32: the same numerics as CPU inference.
    EXPORT=/tmp/nano_export
    PYTHONPATH=$PWD $PY scripts/nano/train_model.py --data .nano/corpus --out "$RUN" --export "$EXPORT" \
        --device "$DEVICE" > /tmp/export.log 2>&1; tail -2 /tmp/export.log
    REL=/tmp/nano_saes/SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16
    PYTHONPATH=$PWD $PY scripts/nano/train_saes.py --model "$EXPORT" --data .nano/corpus --out "$REL" \
        --device "$DEVICE" --threads 8 ${SAE_ARGS:-} 2>&1 | tee "$OUT/sae.log"
    tar cf "$OUT/saes.tar" -C /tmp/nano_saes .
fi
