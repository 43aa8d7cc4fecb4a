#!/usr/bin/env bash
# One call on the H200 device machine: set up, then run the named phases in order, each under its own time limit,
# logs and results under $OUT. A phase that fails or times out is logged and the next one still runs.
#
#   device tool: command "QWEN_SCOPE_COMMIT=<git rev-parse --short HEAD here> bash benchmarks/h200.sh gdn-tests gdn-bench",
#   carry [".gpudeps", ".whl", ".tlc_dev/cache.tar.xz"] (the device copy's git reports a stale HEAD: the results
#   record the commit passed in)
#   on nvidia-h200-x2: "bash benchmarks/h200.sh --split 'gdn-bench collect' 'encode layer-tests layer'" (one list a GPU)
#
# Carried, all git-ignored: .gpudeps/site.tar.xz (tilelang, FLA, FlashQLA: ../shared/gpu/pack-deps .gpudeps), .whl/
# (wheels the device lacks: plotly and narwhals, which `import qwen_scope` needs; plotly's wheel repacked without
# its labextension/, package_data/plotly.min.js, widgetbundle.js and datasets/ (5 MB instead of 10) to fit the carry), .tlc_dev/cache.tar.xz (TileLang's disk
# cache filled on a CPU box by `benchmarks/precompile_h200.sh`; the kernels then load instead of compiling, 10-15 s
# each) and, when an earlier call brought it back, .tlc_dev/triton_cache.tar.xz. Every call returns both caches as
# $OUT/cache.tar.xz (now with FlashQLA's JIT kernels too) and $OUT/triton_cache.tar.xz (FLA's compiled Triton
# kernels, when under 8 MB): copy them into .tlc_dev/ for the next call. Phases:
#   gdn-tests    the Gated DeltaNet GPU suite (the launcher and the public op against the float64 reference)
#   fwd-smoke    the forward's kernels built, then the public op against the float64 reference on every case of
#                the forward's GPU test with a 60 s limit a test (pytest-timeout's thread method: a hung kernel blocks
#                the main thread in the driver, where a signal never lands), so a new kernel that hangs costs a
#                minute, not a whole phase (SMOKE_K selects other tests of that file as pytest -k does)
#   gdn-bench    benchmarks/gdn_forward.py: the public op beside FLA and FlashQLA, FlashQLA's JIT kernels compiled
#                on 10 processes first (GDN_CONFIGS=0,7,8,9 narrows it;
#                GDN_BENCH_ARGS="--skip-fla --skip-torch" times ours and FlashQLA only; gdn-bench:0,1,2 runs those
#                configs, e.g. half the suite per GPU of a --split, joined afterwards by gdn_forward.py --merge)
#   bwd-tests    the Hopper backward kernels against the float64 stage references (tests/flashqla_kernels/
#                test_hopper_bwd_gpu.py), and the public op's dispatch under grad (test_dispatch_gpu.py);
#                BWD_TESTS_K="qwen_layout or ragged" selects tests as pytest -k does
#   ncu          Nsight Compute's counters of each forward stage launched once (benchmarks/ncu_stages.py; NCU_CONFIGS=0,6
#                picks suite configs), with the shared-memory bank conflicts of each kernel (the forward's stages keep
#                the L1 / shared-memory pipe busiest); NCU_FLASHQLA=1 profiles FlashQLA's forward kernels of the same
#                rows beside ours; needs a Firecracker machine (on gVisor ncu cannot read counters)
#   gdn-bwd      benchmarks/gdn_backward.py: forward + backward of the public op beside FLA and FlashQLA, FlashQLA's JIT
#                kernels compiled on 10 processes first (GDN_BWD_ARGS="--rows anchors" narrows it, "--skip-fla" leaves
#                out FLA, whose autotune takes minutes without a carried Triton cache)
#   train-tests  the training step's GPU tests: the cross-entropy kernels against float64, the LM loss against
#                transformers' under bf16 autocast, no host sync
#   train        benchmarks/train_step.py: finetune's step on the 2B shape, transformers (FLA) / FlashQLA's op / ours
#                (TRAIN_ARGS="--arms flashqla,ours --profile" narrows it and adds the per-kind profile; every arm
#                runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the caller sets it)
#   encode-tests the fused TopK SAE encode's GPU tests (tests/saes, marker gpu)
#   encode       benchmarks/topk_encode.py (fused TopK SAE encode vs torch)
#   collect      benchmarks/collect_throughput.py (bare forward / capture / SAE codes; ours vs FLA vs torch GDN;
#                COLLECT_ARGS="--arms ours:a,ours:c24" narrows it)
#   layer-tests  benchmarks/gdn_layer.py --gpu-tests (the fused decoder against transformers' layers; LAYER_TESTS_ONLY=
#                silu_mul,mlp runs only the cases whose ids contain one of those)
#   layer        benchmarks/gdn_layer.py, every arm (ours, ours_op, qla_op, fla, torch, compile, ours+compile);
#                LAYER_PROFILE=N also profiles N forwards of each arm
#   scaling      benchmarks/collect_scaling.py on a host of several GPUs: collect at world sizes 1, 2 and the GPU
#                count under torchrun, tokens/s per GPU, scaling efficiency, each store against the world-size-1 one
#                (SCALING_ARGS="--layers all" for the 24-layer run)
#   collect-profile  benchmarks/collect_profile.py: torch.profiler of (a) and a steady (c1) step: GPU idle, blocking calls
#   glue         benchmarks/glue_kernels.py: each glue kernel alone against the copy floor
#   steer        benchmarks/steer_generate.py (generate as installed, with our patches, the decode engine; STEER_ARGS=
#                "--batches 1 --new 32" narrows it)
#   decode-tests the fused recurrent kernel and the GDN decode step (tests/flashqla_kernels/test_recurrent_gpu.py)
#   decode       benchmarks/decode_kernels.py (the public recurrent op vs FLA's fused recurrent; the layer step)
#   engine-tests the decode engine's GPU tests (graph replay = eager step, fp32 = generate, sampling, no sync)
#   eval         benchmarks/eval_throughput.py (evaluate_saes beside the bare forward)
#   swiglu       the fused gate/up GEMM with the SwiGLU epilogue: its GPU tests, then benchmarks/swiglu_gemm.py
set -o pipefail
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 TILELANG_CACHE_DIR=/tmp/tlcache TRITON_CACHE_DIR=/tmp/triton_cache
export PYTHONPATH=/tmp/site:/tmp/pyt:$PWD
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT" /tmp/site /tmp/pyt /tmp/tlcache /tmp/triton_cache
t0=$(date +%s)
[ -d /tmp/site/tilelang ] || tar xJf .gpudeps/site.tar.xz -C /tmp/site || exit 1
[ -f /tmp/pyt/.done ] || [ ! -d .whl ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pyt .whl/*.whl && touch /tmp/pyt/.done; } || exit 1
# TLC_ARCHIVE: a smaller archive of only the kernels of this call's phases (the carry limit is 64 MiB in all)
tlc=${TLC_ARCHIVE:-.tlc_dev/cache.tar.xz}
[ -f /tmp/tlcache/.done ] || { [ -f "$tlc" ] && tar xJf "$tlc" -C /tmp/tlcache && touch /tmp/tlcache/.done; }
# FLA's Triton kernels compiled on an earlier call (the autotune still runs, the compiles do not)
[ -f /tmp/triton_cache/.done ] || { [ -f .tlc_dev/triton_cache.tar.xz ] \
    && tar xJf .tlc_dev/triton_cache.tar.xz -C /tmp/triton_cache && touch /tmp/triton_cache/.done; }

save_caches() {  # TileLang's cache now also holds FlashQLA's JIT kernels; both come back for the next call
    tar cf - --exclude='./*/cuda-binaries' -C /tmp/tlcache . | xz -T0 -6 > "$OUT/cache.tar.xz"  # kernels only
    tar cf - -C /tmp/triton_cache . | xz -T0 -6 > "$OUT/triton_cache.tar.xz"
    [ "$(stat -c %s "$OUT/triton_cache.tar.xz")" -le 8000000 ] || rm -f "$OUT/triton_cache.tar.xz"  # carry budget
    ls -la "$OUT"/*cache.tar.xz | tee -a "$OUT/phases.log"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} > "$OUT/machine.txt" 2>&1
echo "setup $(( $(date +%s) - t0 )) s; cached kernels: $(find /tmp/tlcache -name executable.so | wc -l)" | tee -a "$OUT/phases.log"
if [ -z "${NO_SAVE_CACHES:-}" ]; then  # the top-level call: SM clocks, power and throttle reasons every 250 ms
    smi_q=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active
    nvidia-smi --query-gpu=$smi_q --format=csv -c 1 > /dev/null 2>&1 || smi_q=timestamp,index,clocks.sm,power.draw
    nvidia-smi --query-gpu=$smi_q --format=csv -lms 250 > "$OUT/smi.csv" 2>&1 &
    smi_pid=$!
    trap 'kill $smi_pid 2>/dev/null' EXIT
fi

phase() {  # phase NAME SECONDS COMMAND...: run with a limit, tee to $OUT/NAME.log, record status and time
    local name=$1 limit=$2 s=$(date +%s); shift 2
    timeout "$limit" bash -c "$(printf '%q ' "$@")" 2>&1 | grep --line-buffered -v ' \[TileLang:.*INFO' | tee "$OUT/$name.log"
    echo "$name: exit ${PIPESTATUS[0]} in $(( $(date +%s) - s )) s" | tee -a "$OUT/phases.log"
}

gdn_tests() {
    python3 benchmarks/gdn_forward.py --precompile 14 --precompile-only
    python3 -m pytest -q -rfE --timeout 300 -p no:cacheprovider tests/flashqla_kernels/test_hopper_gpu.py \
        tests/flashqla_kernels/test_dispatch_gpu.py
}

export -f gdn_tests
if [ "${1:-}" = --split ]; then  # --split "PHASES ON GPU 0" "PHASES ON GPU 1": both at once, outputs in gpu0/, gpu1/
    CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 NO_SAVE_CACHES=1 bash "$0" $2 > "$OUT/gpu0.txt" 2>&1 &
    gpu0_pid=$!
    CUDA_VISIBLE_DEVICES=1 OUT=$OUT/gpu1 NO_SAVE_CACHES=1 bash "$0" $3 > "$OUT/gpu1.txt" 2>&1
    wait $gpu0_pid  # not a bare wait: the nvidia-smi logger runs in the background until killed
    tail -n 4 "$OUT"/gpu*/phases.log
    # the device tool returns a limited number of files: one archive holds them all
    kill $smi_pid 2>/dev/null
    tar czf "$OUT/results.tgz" -C "$OUT" gpu0 gpu1 gpu0.txt gpu1.txt smi.csv && rm -rf "$OUT"/gpu0 "$OUT"/gpu1 "$OUT"/smi.csv
    save_caches
    exit 0
fi
for p in "$@"; do
    case $p in
        gdn-tests) phase gdn-tests "${GDN_TESTS_S:-330}" gdn_tests ;;
        fwd-smoke) phase fwd-smoke "${SMOKE_S:-150}" bash -c "python3 benchmarks/gdn_forward.py --precompile 14 \
                       --precompile-only --configs 0; python3 -m pytest -q -x -rfE --timeout 60 \
                       --timeout-method thread -p no:cacheprovider tests/flashqla_kernels/test_hopper_gpu.py \
                       -k '${SMOKE_K:-public_op_runs}'" ;;
        gdn-bench|gdn-bench:*)  # gdn-bench:0,1,2 names the configs of this GPU (a --split half of the suite)
                   cfg=${p#gdn-bench}; cfg=${cfg#:}
                   phase gdn-bench "${GDN_BENCH_S:-420}" python3 benchmarks/gdn_forward.py \
                       --configs "${cfg:-${GDN_CONFIGS:-}}" --stages --precompile 14 --warm-flashqla 10 --out "$OUT" \
                       ${GDN_BENCH_ARGS:-} ;;
        # kernels the carried cache lacks compile on 14 processes first, not one at a time inside the run (a failure is
        # printed and the run goes on: its tests or rows report it)
        bwd-tests) phase bwd-tests "${BWD_TESTS_S:-240}" bash -c "python3 -c 'from flashqla_kernels.gated_delta_rule.hopper \
                       import backward; backward.precompile(workers=14)'; python3 -m pytest -q -rfE --timeout 200 \
                       -p no:cacheprovider ${BWD_TESTS_K:+-k '$BWD_TESTS_K'} tests/flashqla_kernels/test_hopper_bwd_gpu.py \
                       tests/flashqla_kernels/test_dispatch_gpu.py" ;;
        gdn-bwd) phase gdn-bwd "${GDN_BWD_S:-420}" bash -c "python3 benchmarks/gdn_backward.py --precompile-only \
                     --jobs 14 ${GDN_BWD_ARGS:-}; python3 benchmarks/gdn_backward.py --out '$OUT' --warm-flashqla 10 \
                     --budget-s $(( ${GDN_BWD_S:-420} - 60 )) ${GDN_BWD_ARGS:-}" ;;
        ncu) phase ncu "${NCU_S:-150}" bash -c "\$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1) \
                 --clock-control none --section SpeedOfLight --section Occupancy --section SchedulerStats \
                 --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
                 -k regex:'${NCU_FLASHQLA:+tilelang_fused|tilelang_kkt|}gdn_' python3 benchmarks/ncu_stages.py \
                 --configs ${NCU_CONFIGS:-0} ${NCU_FLASHQLA:+--flashqla}" ;;
        # expandable segments for every arm: the step's 2 GB logits and 1 GB softmax blocks otherwise cost new
        # allocator segments (same H100, ours: 1.583 s a step default, 1.453 expandable)
        train-tests) phase train-tests "${TRAIN_TESTS_S:-150}" python3 -m pytest -q -rfE --timeout 120 -p no:cacheprovider \
                         -m gpu tests/flashqla_kernels/test_decoder_hopper_cross_entropy.py tests/qwen_scope/test_lm_loss.py ;;
        train) phase train "${TRAIN_S:-300}" bash -c "python3 benchmarks/train_step.py --precompile-only --jobs 14; \
                   PYTORCH_CUDA_ALLOC_CONF=\${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
                   python3 benchmarks/train_step.py --out '$OUT' ${TRAIN_ARGS:-}" ;;
        encode-tests) phase encode-tests "${ENCODE_TESTS_S:-240}" python3 -m pytest -q -rfE --timeout 200 -p no:cacheprovider \
                          -m gpu tests/saes ;;
        encode) phase encode "${ENCODE_S:-240}" python3 benchmarks/topk_encode.py --precompile 14 --out "$OUT" ;;
        collect) phase collect "${COLLECT_S:-420}" python3 benchmarks/collect_throughput.py --out "$OUT" --steps 3 \
                     --budget-s "$(( ${COLLECT_S:-420} - 60 ))" ${COLLECT_ARGS:-} ;;
        layer-tests) phase layer-tests "${LAYER_TESTS_S:-200}" python3 benchmarks/gdn_layer.py --gpu-tests --out "$OUT" \
                         --only "${LAYER_TESTS_ONLY:-}" ;;
        scaling) phase scaling "${SCALING_S:-540}" python3 benchmarks/collect_scaling.py --out "$OUT" ${SCALING_ARGS:-} ;;
        collect-profile) phase collect-profile "${PROFILE_S:-150}" python3 benchmarks/collect_profile.py --out "$OUT" \
                             --steps "${PROFILE_STEPS:-5}" ;;
        glue) phase glue "${GLUE_S:-120}" python3 benchmarks/glue_kernels.py --out "$OUT" ;;
        swiglu) phase swiglu "${SWIGLU_S:-240}" bash -c "python3 -m pytest -q -rA --timeout 120 -p no:cacheprovider -m gpu \
                    tests/flashqla_kernels/test_decoder_hopper_swiglu_gemm.py; python3 benchmarks/swiglu_gemm.py --out $OUT" ;;
        decode-tests) phase decode-tests "${DECODE_TESTS_S:-150}" python3 -m pytest -q -rfE --timeout 120 -p no:cacheprovider \
                          tests/flashqla_kernels/test_recurrent_gpu.py ;;
        decode) phase decode "${DECODE_S:-120}" python3 benchmarks/decode_kernels.py --out "$OUT" ;;
        engine-tests) phase engine-tests "${ENGINE_TESTS_S:-150}" python3 -m pytest -q -rfE --timeout 120 -p no:cacheprovider \
                          tests/qwen_scope/test_engine_gpu.py ;;
        eval) phase eval "${EVAL_S:-240}" python3 benchmarks/eval_throughput.py --out "$OUT" ;;
        steer) phase steer "${STEER_S:-300}" python3 benchmarks/steer_generate.py --out "$OUT" ${STEER_ARGS:-} \
                   --budget-s "$(( ${STEER_S:-300} - 40 ))" ;;
        layer) phase layer "${LAYER_S:-400}" python3 benchmarks/gdn_layer.py --arms "${LAYER_ARMS:-ours,ours_op,qla_op,fla,torch,compile,ours+compile}" \
                   --profile "${LAYER_PROFILE:-0}" --out "$OUT" ;;
        *) echo "unknown phase $p" | tee -a "$OUT/phases.log" ;;
    esac
done
if [ -z "${NO_SAVE_CACHES:-}" ]; then
    kill $smi_pid 2>/dev/null
    # the device tool returns a limited number of files: the results and logs travel as one archive
    # (one archive per invocation, so a second `bash h200.sh ...` in the same call keeps the first one's logs)
    archive=results-$(date +%H%M%S).tgz
    (cd "$OUT" && tar czf "$archive" --exclude='*cache.tar.xz' --exclude='results*.tgz' --exclude=phases.log . \
        && find . -maxdepth 1 -type f ! -name '*cache.tar.xz' ! -name 'results*.tgz' ! -name phases.log -delete)
    save_caches
fi
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.log"
