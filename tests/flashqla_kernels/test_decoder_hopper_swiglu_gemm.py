"""The fused SwiGLU GEMM (``flashqla_kernels.decoder.hopper.swiglu_gemm``): ``silu(x @ Wg^T) * (x @ Wu^T)`` in one
kernel.

CPU: the default config compiles for sm_90a with the intended structure (wgmma, TMA loads and store, a producer
warpgroup, no per-tile __syncthreads) and without register spills (ptxas -v); ``-m slow`` does the same for every
benchmark variant and test specialisation. The shape reasons, the launcher's input errors, the fp32 formulation and
the benchmark's CPU dry run. GPU (sm_90): the kernel against the float64 formulation for M = 1, 100, 4096 + 37 and
32768 at the 2B MLP (N = 6144, K = 2048) and a small N / K, bf16 and fp16, outputs poisoned with NaN first; every
benchmark variant at a ragged M; batched and non-contiguous inputs.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashqla_kernels import toolkit
from flashqla_kernels.decoder import hopper

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc to compile for sm_90a")
H200_SMS = 132


def _bench():
    spec = importlib.util.spec_from_file_location("bench_swiglu_gemm", ROOT / "benchmarks" / "swiglu_gemm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source(args: tuple) -> str:
    pytest.importorskip("tilelang")
    from flashqla_kernels.decoder.hopper.swiglu_gemm import build_swiglu_gemm

    return toolkit.compile_kernel(build_swiglu_gemm, *args).get_kernel_source()


def _ptxas_report(src: str, tmp_path: Path) -> str:
    """ptxas -v of the generated CUDA (what TileLang's own nvcc call builds)."""
    import tilelang

    root = os.path.dirname(tilelang.__file__)
    (tmp_path / "k.cu").write_text(src)
    cmd = [NVCC, "-arch=sm_90a", "-std=c++17", "-cubin", "-o", str(tmp_path / "k.cubin"), "-Xptxas", "-v",
           "--use_fast_math", "-w", "-DENABLE_BF16", f"-I{root}/src", f"-I{root}/3rdparty/cutlass/include",
           str(tmp_path / "k.cu")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def _default_args(N: int = 6144, K: int = 2048, sms: int = H200_SMS) -> tuple:
    from flashqla_kernels.decoder.hopper.swiglu_gemm import DEFAULT_CONFIG, builder_args

    return builder_args(N, K, "bfloat16", DEFAULT_CONFIG, sms)


@needs_nvcc
def test_default_kernel_is_a_warp_specialised_tma_wgmma_gemm_with_both_products_in_flight(tmp_path):
    """The launcher's kernel for the 2B MLP: a 128-thread TMA producer beside two consumer warpgroups, 64 x 128 wgmmas
    of g and u with one wait a K step, the output through stmatrix and a TMA store; persistent, with no
    __syncthreads inside the tile loop (only the consumers' own barrier around the epilogue); no register spills."""
    pytest.importorskip("tilelang")
    src = _source(_default_args())
    body = src[src.index("__launch_bounds__"):]
    assert body.startswith("__launch_bounds__(384, 1)")
    assert "if (((int)threadIdx.x) < 128)" in body
    for name in ("X", "Wg", "Wu"):
        assert f"tl::tma_load({name}_desc" in body, f"no TMA load of {name}"
    assert "tl::tma_store(Out_desc" in body and "ptx_stmatrix" in body
    assert body.count("tl::wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, "
                      "64, 128, 16") == 2
    assert body.count("tl::warpgroup_wait<0>()") == 1
    loop = body[body.index("for (int w = 0;"):]
    assert "__syncthreads()" not in loop and loop.count("__sync_thread_partial(1, 256)") == 2
    # the store's issuing thread waits for it before the next tile's epilogue and once after the last tile, not
    # right after issuing it
    assert loop.count("tl::tma_store_wait<0, true>()") == 2
    assert loop.index("tl::tma_store_wait") < loop.index("__sync_thread_partial") < loop.index("tl::tma_store(")
    assert "expf" in body
    report = _ptxas_report(src, tmp_path)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report[-800:]
    # ptxas found no wgmma accumulator read before its wait (it would serialise the wgmmas and say so)
    assert "C7517" not in report and "Potential Performance Loss" not in report, report[-800:]


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("args", _bench().specialisations() if importlib.util.find_spec("tilelang") else [],
                         ids=str)
def test_every_benchmark_variant_and_test_specialisation_compiles_without_spills(args, tmp_path):
    src = _source(args)
    assert "tl::tma_load(Wu_desc" in src and "wgmma_ss<" in src and "tl::tma_store(Out_desc" in src
    report = _ptxas_report(src, tmp_path)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report[-800:]


def test_shape_reasons_name_the_shape():
    assert hopper.swiglu_shape_reason(6144, 2048, torch.bfloat16) is None
    assert hopper.swiglu_shape_reason(256, 128, torch.float16) is None
    assert "N=6100" in hopper.swiglu_shape_reason(6100, 2048, torch.bfloat16)
    assert "K=2000" in hopper.swiglu_shape_reason(6144, 2000, torch.bfloat16)
    assert "torch.float32" in hopper.swiglu_shape_reason(6144, 2048, torch.float32)
    x, w = torch.zeros(3, 2000, dtype=torch.bfloat16), torch.zeros(6144, 2000, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=2000 input channels"):
        hopper.swiglu_gemm_fwd(x, w, w)


def test_the_shape_reason_tiles_are_the_default_config():
    pytest.importorskip("tilelang")
    from flashqla_kernels.decoder.hopper.swiglu_gemm import DEFAULT_CONFIG

    assert (hopper.SWIGLU_BLOCK_N, hopper.SWIGLU_BLOCK_K) == (DEFAULT_CONFIG.BN, DEFAULT_CONFIG.BK)


def test_launcher_rejects_inputs_it_cannot_take_before_compiling():
    pytest.importorskip("tilelang")
    from flashqla_kernels.decoder.hopper.swiglu_gemm import SwigluGemmConfig, swiglu_gemm

    bf = torch.bfloat16
    x, w = torch.zeros(5, 128, dtype=bf), torch.zeros(256, 128, dtype=bf)
    with pytest.raises(ValueError, match="bfloat16 or float16 activations, got x torch.float32"):
        swiglu_gemm(x.float(), w, w)
    with pytest.raises(ValueError, match="weights in x's dtype torch.bfloat16; got w_gate torch.float16"):
        swiglu_gemm(x, w.half(), w)
    with pytest.raises(ValueError, match=r"K = x.shape\[-1\] = 128; got w_gate \(256, 128\), w_up \(128, 128\)"):
        swiglu_gemm(x, w, w[:128])
    with pytest.raises(ValueError, match="K = x.shape"):
        swiglu_gemm(x, w[:, :64], w[:, :64])
    with pytest.raises(ValueError, match="BN=256 .* got N=384"):
        swiglu_gemm(x, torch.zeros(384, 128, dtype=bf), torch.zeros(384, 128, dtype=bf),
                    config=SwigluGemmConfig(BN=256))
    with pytest.raises(ValueError, match="one CUDA device; got x on cpu"):
        swiglu_gemm(x, w, w)


def test_reference_is_silu_of_gate_times_up_in_fp32_or_wider():
    pytest.importorskip("tilelang")
    from flashqla_kernels.decoder.hopper.swiglu_gemm import swiglu_gemm, swiglu_reference

    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    wg, wu = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    got = swiglu_reference(x, wg, wu)
    g, u = x.double() @ wg.double().T, x.double() @ wu.double().T
    assert got.dtype == torch.float32 and got.shape == (2, 3, 32)
    torch.testing.assert_close(got.double(), g / (1 + torch.exp(-g)) * u, rtol=1e-5, atol=1e-5)
    assert swiglu_reference(x.double(), wg.double(), wu.double()).dtype == torch.float64
    # one signature across the formulation, the launcher and the dispatch wrapper
    functions = (swiglu_reference, swiglu_gemm, hopper.swiglu_gemm_fwd)
    assert [list(inspect.signature(f).parameters)[:3] for f in functions] == [["x", "w_gate", "w_up"]] * 3


def test_benchmark_variants_lead_with_the_default_and_its_dry_run_writes_the_tables(tmp_path):
    pytest.importorskip("tilelang")
    from flashqla_kernels.decoder.hopper.swiglu_gemm import DEFAULT_CONFIG, build_swiglu_gemm

    bench = _bench()
    assert bench.VARIANTS[0][1] == DEFAULT_CONFIG and 5 <= len(bench.VARIANTS) <= 8
    for args in bench.specialisations():
        inspect.signature(build_swiglu_gemm).bind(*args)
    script = ROOT / "benchmarks" / "swiglu_gemm.py"
    out = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "swiglu_gemm.json").read_text())
    arms = [r["arm"] for r in result["rows"]]
    assert arms[:2] == ["cublas+silu_mul", "cublas gate+up"] and len(arms) == 3 + len(bench.VARIANTS)
    assert all(r["ok"] and r["rel_l2_vs_cublas"] < 1e-2 for r in result["rows"] if r["arm"].startswith("fused"))
    assert "| fused persistent s4 p16 |" in (tmp_path / "swiglu_gemm.md").read_text()


# ---------------------------------------------------------------------------------------------- on an sm_90 GPU
DEV = "cuda"
GPU_TOL = {torch.bfloat16: 5e-3, torch.float16: 1e-3}


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _inputs(M, N, K, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEV).to(dtype)
    wg = (torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).to(dtype)
    wu = (torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).to(dtype)
    return x, wg, wu


def _check(out, x, wg, wu, label):
    from flashqla_kernels.decoder.hopper.swiglu_gemm import swiglu_reference

    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], wg.shape[0]), label
    assert not out.isnan().any(), f"{label}: unwritten (NaN) elements"
    err = _rel(out, swiglu_reference(x.double(), wg.double(), wu.double()))
    assert err < GPU_TOL[x.dtype], f"{label}: rel-L2 {err:.2e}"


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("N,K", [(6144, 2048), (256, 128)])
@pytest.mark.parametrize("M", [1, 100, 4096 + 37, 32768])
def test_kernel_matches_the_float64_formulation(M, N, K, dtype):
    x, wg, wu = _inputs(M, N, K, dtype)
    with toolkit.poisoned_outputs():
        out = hopper.swiglu_gemm_fwd(x, wg, wu)
    _check(out, x, wg, wu, f"M={M} N={N} K={K} {dtype}")
    assert torch.equal(out, hopper.swiglu_gemm_fwd(x, wg, wu)), "not deterministic"


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("name", [name for name, _ in _bench().VARIANTS] if importlib.util.find_spec("tilelang")
                         else [])
def test_every_benchmark_variant_matches_at_a_ragged_M(name):
    from flashqla_kernels.decoder.hopper import swiglu_gemm as stage

    config = dict(_bench().VARIANTS)[name]
    x, wg, wu = _inputs(4096 + 37, 6144, 2048, torch.bfloat16)
    with toolkit.poisoned_outputs():
        out = stage.swiglu_gemm(x, wg, wu, config=config)
    _check(out, x, wg, wu, name)


@pytest.mark.gpu
@pytest.mark.hopper
def test_batched_and_non_contiguous_inputs():
    x, wg, wu = _inputs(2 * 50, 256, 128, torch.bfloat16)
    batched = x.view(2, 50, 128)
    strided = batched.transpose(0, 1).contiguous().transpose(0, 1)  # [2, 50, K], not contiguous
    assert not strided.is_contiguous()
    for label, xs in (("batched", batched), ("non-contiguous", strided)):
        with toolkit.poisoned_outputs():
            out = hopper.swiglu_gemm_fwd(xs, wg, wu)
        _check(out, xs, wg, wu, label)


@pytest.mark.gpu
@pytest.mark.hopper
def test_rows_past_M_are_not_written():
    """The TMA store clips the last row block at M: rows of a larger buffer after the output stay untouched."""
    from flashqla_kernels.decoder.hopper.swiglu_gemm import build_swiglu_gemm

    M, N, K = 100, 256, 128
    x, wg, wu = _inputs(M, N, K, torch.bfloat16)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    buffer = torch.full((M + 128, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    toolkit.compile_kernel(build_swiglu_gemm, *_default_args(N, K, sms))(x, wg, wu, buffer[:M])
    _check(buffer[:M], x, wg, wu, "first M rows")
    assert buffer[M:].isnan().all(), "rows past M written"
