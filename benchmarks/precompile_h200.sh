#!/usr/bin/env bash
# Compile, on a CPU box with nvcc, every TileLang kernel that benchmarks/h200.sh runs on the H200, and pack TileLang's
# disk cache as .tlc_dev/cache.tar.xz (a few MB) for the device call to carry: there the kernels load in well under a
# second instead of JIT-compiling for 10-15 s each, and device minutes go to measuring.
#
#   bash benchmarks/precompile_h200.sh [JOBS]      (from the repo root, with .venv and .gpudeps/site.tar.xz present)
#
# The cache only hits on the device if the CUDA sources and nvcc options are byte-identical there. TileLang passes
# its include directories as absolute paths, so the compile must see tilelang at the device's path, /tmp/site/tilelang
# (the .gpudeps copy: its libraries are the ones in .venv, byte for byte). Only tilelang is unpacked there; tvm_ffi
# and the rest come from .venv (the .gpudeps builds are for CPython 3.12).
#   bash benchmarks/precompile_h200.sh JOBS layer   only the kernels of the layer / glue / swiglu / encode / collect
#                                                   phases, into .tlc_dev/cache_layer.tar.xz (2-3 MB: pass it to
#                                                   h200.sh as TLC_ARCHIVE when the full cache would not fit the carry)
set -euo pipefail
jobs=${1:-2}
set_name=${2:-all}
site=/tmp/site
if [ ! -d "$site/tilelang" ]; then
    mkdir -p "$site"
    tar xJf .gpudeps/site.tar.xz -C "$site" ./tilelang ./tilelang-0.1.15.dist-info
fi
archive=.tlc_dev/cache.tar.xz
export TILELANG_CACHE_DIR=$PWD/.tlc_dev/cache PYTHONPATH=$site:$PWD
if [ "$set_name" = layer ]; then
    archive=.tlc_dev/cache_layer.tar.xz
    export TILELANG_CACHE_DIR=$PWD/.tlc_dev/cache_layer
fi
py=.venv/bin/python
quiet() { grep -v ' \[TileLang:.*INFO' || true; }
if [ "$set_name" != layer ]; then
    $py benchmarks/gdn_forward.py --precompile "$jobs" --precompile-only --sms 132 2>&1 | quiet
    # the backward: the GPU test's layouts, then the fwd+bwd benchmark's
    $py -c "from flashqla_kernels.gated_delta_rule.hopper import backward as b; b.precompile(workers=$jobs)" 2>&1 | quiet
    $py benchmarks/gdn_backward.py --precompile-only --jobs "$jobs" 2>&1 | quiet
    $py benchmarks/train_step.py --precompile-only 2>&1 | quiet
fi
$py benchmarks/topk_encode.py --precompile "$jobs" --precompile-only 2>&1 | quiet
$py benchmarks/collect_throughput.py --precompile 2>&1 | quiet
$py benchmarks/gdn_layer.py --precompile --jobs "$jobs" 2>&1 | quiet
$py benchmarks/glue_kernels.py --precompile 2>&1 | quiet
$py benchmarks/swiglu_gemm.py --precompile 2>&1 | quiet
$py benchmarks/decode_kernels.py --precompile 2>&1 | quiet
rm -rf "$TILELANG_CACHE_DIR"/*/*/.staging
# only the built kernels travel: cuda-binaries/ is nvcc's output cache for compiles (a loaded kernel never reads it;
# checked: a kernel loads in 0.13 s from kernels/ alone), and it is 40% of the archive
tar cf - --exclude='./*/cuda-binaries' -C "$TILELANG_CACHE_DIR" . | xz -T0 -6 > "$archive.tmp" && mv "$archive.tmp" "$archive"
echo "packed $(find "$TILELANG_CACHE_DIR" -name executable.so | wc -l) kernels: $(du -h "$archive" | cut -f1)"
