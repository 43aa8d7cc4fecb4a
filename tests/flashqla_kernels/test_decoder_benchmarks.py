"""The decoder's benchmarks are ready for the H200: ``benchmarks/gdn_layer.py`` parses --help, buckets kernel names,
and its CPU dry run (--tiny) runs the eager arms end to end, checks them against the torch arm and writes the JSON +
markdown; its GPU-test runner (``plain_tests``) expands every case; the precompile list (``layer_kernels``) and the
glue-kernel variants (``glue_kernels.py``) bind to the decoder's builders."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gdn_layer.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gdn_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_parses():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "--arms" in out.stdout and "--precompile" in out.stdout and "--tiny" in out.stdout


def test_kernel_names_fall_in_the_issue_buckets(bench):
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "GEMM",
        "gdn_fused_fwd_kernel": "GDN op", "gdn_prep_kernel": "GDN op",
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "GDN op",
        "gdn_conv_qkv_gates_kernel": "conv",
        "void at::native::conv_depthwise2d_forward_kernel<1, c10::BFloat16, int>": "conv",
        "gdn_gated_rms_norm_kernel": "norms",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps>>": "norms",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>": "copies",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copies",
        "void at::native::vectorized_elementwise_kernel<4, silu_kernel>": "elementwise",
        "triton_poi_fused_add_mul_silu_0": "elementwise",
        "mlp_silu_mul_kernel": "elementwise",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "attention_gate_mul_kernel": "elementwise",
        "qwen_qk_norm_rope_kernel": "norms",
    }
    assert {n: bench.categorize(n) for n in names} == names


def test_tiny_dry_run_writes_checked_results(tmp_path, bench):
    assert bench.main(["--tiny", "--arms", "ours,ours_op,qla_op,torch", "--steps", "1", "--warmup", "0", "--profile",
                       "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gdn_layer.json").read_text())
    rows = {r["arm"]: r for r in result["arms"]}
    assert set(rows) == {"ours", "ours_op", "qla_op", "torch"} and all("tokens_per_s" in r for r in rows.values())
    # fp32 on CPU: every arm computes the same model
    for arm in ("ours", "ours_op", "qla_op"):
        assert max(result["checks"][arm].values()) < 1e-5, result["checks"][arm]
    assert rows["ours"]["breakdown"]["total_ms"] > 0
    # --profile: the idle analysis of each arm, rendered
    assert rows["ours"]["profile"]["steps"] == 1 and "gpu_idle_share" in rows["ours"]["profile"]
    assert "Profile of ours (1 forwards" in (tmp_path / "gdn_layer.md").read_text()
    md = (tmp_path / "gdn_layer.md").read_text()
    assert "| ours |" in md and "x qla_op" in md
    from flashqla_kernels import is_patched

    assert not is_patched()
    # a second call with --merge replaces its own arm and keeps the others
    assert bench.main(["--tiny", "--arms", "torch", "--steps", "1", "--warmup", "0", "--merge",
                       "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "gdn_layer.json").read_text())
    assert sorted(r["arm"] for r in merged["arms"]) == ["ours", "ours_op", "qla_op", "torch"]
    assert set(merged["checks"]) == {"ours", "ours_op", "qla_op", "torch"}


def test_gpu_test_runner_expands_every_parametrized_case(bench):
    from tests.flashqla_kernels import test_decoder_gpu as gpu_tests

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plain_tests

    cases = plain_tests.test_cases(gpu_tests)
    ids = [case_id for case_id, _, _ in cases]
    # ... then the backward kernels (conv 5, rms 4, gated 3, silu 2), the training step (2), the fp32 norms (1)
    assert len(ids) == len(set(ids)) == 6 + 6 * 4 + 3 + 4 + 3 + 1 + 6 + 1 + 1 + 2 + 1 + 4 + 1 + 5 + 4 + 3 + 2 + 2 + 1
    conv = [kw for case_id, _, kw in cases if case_id.startswith("test_conv_gates")]
    assert sorted(kw["name"] for kw in conv) == sorted(gpu_tests.CONV_CASES)
    piped = [kw for case_id, _, kw in cases if case_id.startswith("test_pipelined_conv")]
    shapes = [(16, 8), (16, 3), (32, 4), (None, None)]
    assert sorted((kw["name"], shapes.index((kw["BT"], kw["tiles"]))) for kw in piped) == sorted(
        (name, i) for name in gpu_tests.CONV_CASES for i in range(len(shapes)))
    silu = [kw for case_id, _, kw in cases if case_id.startswith("test_silu_mul_kernel")]
    assert sorted(kw["name"] for kw in silu) == sorted(gpu_tests.SILU_CASES)
    assert "test_patched_mlp_runs_the_kernel_and_matches_transformers_within_bf16" in ids
    layer = [kw for case_id, _, kw in cases if case_id.startswith("test_fused_layer")]
    assert layer == [{"Hk": 16, "Hv": 16}, {"Hk": 16, "Hv": 32}]


def test_gpu_test_runner_works_without_pytest(bench, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plain_tests

    marks = plain_tests.MarkFactory()

    @marks.parametrize("a,b", [(1, 2), (3, 4)])
    @marks.parametrize("c", ["x"])
    @marks.gpu
    def test_fake(a, b, c):
        pass

    fake = type(sys)("fake_tests")
    fake.test_fake = test_fake
    assert [(i, kw) for i, _, kw in plain_tests.test_cases(fake)] == [
        ("test_fake[1,2,x]", {"a": 1, "b": 2, "c": "x"}), ("test_fake[3,4,x]", {"a": 3, "b": 4, "c": "x"})]
    mp = plain_tests.MonkeyPatch()
    mp.setattr(bench, "ARMS", ())
    assert bench.ARMS == ()
    mp.undo()
    assert "ours" in bench.ARMS


def test_precompile_covers_the_benchmark_and_gpu_test_kernels(bench):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import layer_kernels

    specs = layer_kernels.kernel_specs()
    builders = {(m.rsplit(".", 1)[-1].removeprefix("chunk:"), b) for m, b, _ in specs}
    assert {("conv_gates", "build_conv_qkv_gates"), ("gated_norm", "build_gated_rms_norm"),
            ("rms_norm", "build_rms_norm"), ("silu_mul", "build_silu_mul"), ("kkt_solve", "kkt_solve"),
            ("chunk_fwd", "chunk_fwd"), ("segment_states", "segment_states"),
            ("state_scan", "state_scan")} <= builders
    # the 2B model's layout: conv (Hk = Hv = 16, K = 128, width 4, bf16), gated norm V = 128, RMSNorm 2048 and 256
    assert ("flashqla_kernels.decoder.hopper.conv_gates", "build_conv_qkv_gates",
            (16, 16, 128, 4, "bfloat16", False, False)) in specs
    rms = {args for _, b, args in specs if b == "build_rms_norm"}
    assert rms >= {(2048, "bfloat16", 1e-6), (256, "bfloat16", 1e-6)}
    # the MLP's silu(gate) * up at the 2B intermediate size 6144, and every GPU-test specialisation
    silu = {args for _, b, args in specs if b == "build_silu_mul"}
    assert silu == {(6144, "bfloat16"), (6144, "float16"), (64, "bfloat16"), (64, "float16")}
    assert len(specs) == len(set(specs))


def test_precompile_covers_the_norms_launched_under_autocast(monkeypatch):
    """The keys the RMSNorm launchers compile for the 2B model's fp32 residual stream under bf16 autocast (the norm
    written in bf16, the add's b bf16, the backward reading a bf16 dy, with and without the residual's gradient) are
    in the precompile list."""
    pytest.importorskip("tilelang")
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import layer_kernels

    from flashqla_kernels.decoder.hopper import rms_norm

    keys = []
    monkeypatch.setattr(rms_norm, "compile_kernel",
                        lambda builder, *args: keys.append((builder.__name__, args)) or (lambda *tensors: None))
    bf = torch.bfloat16
    x, h, w = torch.randn(3, 2048), torch.randn(3, 2048, dtype=bf), torch.zeros(2048)
    rms_norm.rms_norm(x, w, 1e-6, out_dtype=bf)
    rms_norm.add_rms_norm(x, h, w, 1e-6, out_dtype=bf)
    rms_norm.rms_norm_bwd(x, w, 1e-6, h)
    rms_norm.rms_norm_bwd(x, w, 1e-6, h, x)
    assert len(keys) == 4 and all(args[-1] == "bfloat16" for _, args in keys)
    assert set(keys) <= {(b, args) for _, b, args in layer_kernels.kernel_specs()}


def test_glue_benchmark_variants_bind_to_their_builders_and_lead_with_the_launch_defaults():
    """benchmarks/glue_kernels.py: every variant's arguments bind to its builder, and each stage's first entry is
    the specialisation the launcher compiles (so the table's first row per stage is what the model runs)."""
    import inspect

    spec = importlib.util.spec_from_file_location("bench_glue", ROOT / "benchmarks" / "glue_kernels.py")
    glue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(glue)
    from flashqla_kernels.decoder.hopper import attn_glue, conv_gates, gated_norm, rms_norm, silu_mul

    modules = {"conv_gates": conv_gates, "rms_norm": rms_norm, "gated_norm": gated_norm, "silu_mul": silu_mul,
               "attn_glue": attn_glue}
    firsts = {}
    for stage, module, builder, args in glue.VARIANTS:
        inspect.signature(getattr(modules[module], builder)).bind(*args)
        firsts.setdefault(stage, args)
    # the launchers' keys: conv (Hk, Hv, D, Kc, dtype, prefix, bias) + the default pipelined (BT, threads, tiles),
    # RMSNorm with a bf16 weight, gated norm
    bt, tiles = conv_gates.pipelined_shape(128)
    assert conv_gates.PIPELINED
    assert firsts["conv"] == (16, 16, 128, 4, "bfloat16", False, False, bt, conv_gates.THREADS, tiles)
    assert firsts["rms_norm"] == (2048, "bfloat16", 1e-6, "bfloat16")
    assert firsts["gated_norm"] == (128, "bfloat16", 1e-6)
    assert {s for s, *_ in glue.VARIANTS} >= {"conv", "rms_norm", "gated_norm", "silu_mul", "qk_norm_rope",
                                              "gate_mul", "gate_mul_head_major"}


def test_gpu_test_runner_reports_pass_skip_xfail_and_fail(tmp_path):
    """plain_tests.run_module: a passing case prints PASS with its output, pytest.skip gives SKIP, pytest.xfail XFAIL
    (not a failure), an assertion FAIL (counted)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plain_tests

    fake = type(sys)("fake_gpu_tests")

    def test_ok():
        print("measured 1.0")

    def test_skipped():
        pytest.skip("no GPU")

    def test_near_tie():
        pytest.xfail("near-tie")

    def test_broken():
        assert 1 == 2

    for fn in (test_ok, test_skipped, test_near_tie, test_broken):
        setattr(fake, fn.__name__, fn)
    out = tmp_path / "log.txt"
    assert plain_tests.run_module(fake, out, "# header") == 1
    lines = out.read_text().splitlines()
    assert lines[0] == "# header"
    assert "PASS test_ok measured 1.0" in lines and any(x.startswith("SKIP test_skipped") for x in lines)
    assert any(x.startswith("XFAIL test_near_tie (near-tie") for x in lines)
    assert any(x.startswith("FAIL test_broken") for x in lines)


def test_flashqla_arm_patches_flashqlas_op_in_under_transformers_call_convention(tmp_path, bench):
    """flashqla_op: FlashQLA's public op in transformers' module global, called as transformers calls its chunk op
    (extra keywords dropped); where flash-qla is not installed the arm is reported, not run."""
    seen = []
    wrapped = bench.flashqla_for_transformers(lambda *a, **kw: seen.append((a, kw)) or ("o", "state"))
    assert wrapped("q", "k", "v", "g", "b", chunk_size=64, initial_state="h0", output_final_state=True,
                   use_qk_l2norm_in_kernel=True, cu_seqlens=None, use_cache=False) == ("o", "state")
    assert seen == [(("q", "k", "v", "g", "b"), dict(scale=None, initial_state="h0", output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True, cu_seqlens=None))]
    if bench.flashqla_chunk() is not None:
        pytest.skip("flash-qla is installed here: the arm runs instead of being reported")
    assert bench.main(["--tiny", "--arms", "flashqla_op", "--steps", "1", "--warmup", "0", "--out",
                       str(tmp_path)]) == 0
    row = json.loads((tmp_path / "gdn_layer.json").read_text())["arms"][0]
    assert row["arm"] == "flashqla_op" and row["note"] == "flash-qla is not importable" and "tokens_per_s" not in row


def test_value_heads_option_builds_the_wider_gdn_layout_and_every_arm_computes_the_same_model(tmp_path, bench):
    """--value-heads 4 over the tiny model's 2 key heads (the 9B layout's GVA, Hv = 2 Hk): the label says so and the
    op patch alone computes what the torch arm does."""
    assert bench.main(["--tiny", "--value-heads", "4", "--arms", "ours_op,torch", "--steps", "1", "--warmup", "0",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gdn_layer.json").read_text())
    assert result["model"].endswith("GDN layers with 4 value heads over 2 key heads")
    assert max(result["checks"]["ours_op"].values()) < 1e-5, result["checks"]["ours_op"]
    assert "4 value heads over 2 key heads" in (tmp_path / "gdn_layer.md").read_text()
