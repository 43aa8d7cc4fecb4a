"""benchmarks/gdn_forward.py: its precompile list is what the public op compiles, and half-suite runs merge."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flashqla_kernels.gated_delta_rule.hopper import plan

REPO = Path(__file__).resolve().parents[2]


def _gdn_forward():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gdn_forward

    return gdn_forward


@pytest.mark.parametrize("config", [(16, 32, 8192, 1), (16, 32, 4096, 16), (2, 8, 32768, 1)])
def test_precompile_specs_are_the_kernels_the_public_op_compiles(config, monkeypatch):
    """benchmarks/gdn_forward.py's precompile list names each kernel with the very arguments the launcher passes to
    ``compile_kernel`` (else the carried cache misses and the device JIT-compiles). The public op runs on CPU with the
    device check passed and every kernel replaced by a no-op, a context-parallel layout included."""
    pytest.importorskip("tilelang")
    import flashqla_kernels
    from flashqla_kernels import dispatch, toolkit
    from flashqla_kernels.gated_delta_rule.hopper import forward

    stages = {"build_kkt_solve": "kkt_solve", "build_chunk_fwd": "chunk_fwd",
              "build_segment_states": "segment_states", "build_state_scan": "state_scan"}
    seen = set()
    monkeypatch.setattr(toolkit, "compile_kernel",
                        lambda builder, *args: seen.add((stages[builder.__name__], args)) or (lambda *a: None))
    monkeypatch.setattr(dispatch, "hopper_reason", lambda *tensors: None)
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)
    Hk, Hv, seqlen, nseq = config
    q = k = torch.zeros(1, seqlen * nseq, Hk, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, seqlen * nseq, Hv, 128, dtype=torch.bfloat16)
    g = beta = torch.zeros(1, seqlen * nseq, Hv)
    h0 = torch.zeros(nseq, Hv, 128, 128)
    cu = torch.arange(0, seqlen * nseq + 1, seqlen, dtype=torch.int32)
    assert forward.unsupported_reason(q, k, v, g, beta, h0, cu) is None
    with torch.no_grad():
        flashqla_kernels.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, backend="tilelang")
    assert {s for s, _ in seen} >= {"kkt_solve", "chunk_fwd"}
    if config == (16, 32, 8192, 1):
        assert {s for s, _ in seen} == {"kkt_solve", "segment_states", "state_scan", "chunk_fwd"}
    specs = set(_gdn_forward().kernel_specs([config], 132))
    assert seen <= specs, f"compiled but not precompiled: {seen - specs}"


def test_benchmark_merges_runs_over_disjoint_configs():
    """gdn_forward.py --merge: rows of two half-suite runs (one per GPU) in suite order, geomeans over all rows,
    overlapping or mismatched runs refused."""
    gdn_forward = _gdn_forward()
    from gdn_forward_report import merge

    def row(i, ours, fla):
        Hk, Hv, seqlen, nseq = gdn_forward.SUITE[i]
        return {"Hk": Hk, "Hv": Hv, "seqlen": seqlen, "nseq": nseq, "speedup_vs_fla": fla / ours,
                "ratio_vs_flashqla": 1.0}

    def part(rows, date):
        return {"gpu": "H200", "commit": "c", "date": date, "bf16_matmul_tflops": 790.0, "copy_tbps": 4.2,
                "method": "m", "configs_planned": len(rows), "rows": rows}

    a, b = part([row(5, 1.0, 2.0), row(0, 1.0, 8.0)], "d1"), part([row(3, 1.0, 4.0)], "d2")
    merged = merge([a, b], gdn_forward.SUITE)
    assert [(r["Hk"], r["Hv"], r["seqlen"], r["nseq"]) for r in merged["rows"]] == [gdn_forward.SUITE[i]
                                                                                      for i in (0, 3, 5)]
    assert merged["geomean_speedup_vs_fla"] == pytest.approx(4.0)
    assert merged["configs_planned"] == 3 and [p["date"] for p in merged["parts"]] == ["d1", "d2"]
    with pytest.raises(ValueError, match="overlap"):
        merge([a, a], gdn_forward.SUITE)
    with pytest.raises(ValueError, match="commit"):
        merge([a, {**b, "commit": "other"}], gdn_forward.SUITE)


def _gdn_backward():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gdn_backward

    return gdn_backward


def test_backward_benchmark_report_renders_rows_errors_the_geomean_the_ab_arms_and_the_stages(tmp_path):
    bwd = _gdn_backward()
    rows = [{"Hk": 16, "Hv": 32, "seqlen": 8192, "nseq": 1,
             "ms": {"fla": 3.0, "flashqla": 1.5, "ours": 1.2, "ours_per_value_head": 1.0},
             "stages_ms": {"segment_chunks": 32, "kkt_solve": 0.05, "dh walk": 0.25},
             "grad_rel_l2_vs_fla": {"ours": {"dq": 0.004, "dk": 0.006}, "flashqla": {"dq": 0.003}},
             "bytes_floor_ms": 0.1, "flop_floor_ms": 0.18, "ratio_vs_flashqla": 1.25, "anchor_fla_ms": 3.125,
             "anchor_flashqla_ms": 1.553},
            {"Hk": 2, "Hv": 8, "seqlen": 32768, "nseq": 1, "ms": {"fla": 0.9}, "grad_rel_l2_vs_fla": {},
             "bytes_floor_ms": 0.05, "flop_floor_ms": 0.04, "errors": {"flashqla": "RuntimeError: no kernel"}}]
    bwd.write(tmp_path, {"env": {"gpu": "NVIDIA H200", "date": "2026-12-03", "torch": "2.11"}, "rows": rows})
    md = (tmp_path / "gdn_backward.md").read_text()
    assert "| 16/32 | 8192x1 | 3.000 | 1.500 | 1.200 | 1.25 | 0.100 / 0.180 | 3.125 / 1.553 | 0.0060 |  |" in md
    assert "| 2/8 | 32768x1 | 0.900 | - | - | - |" in md and "flashqla: RuntimeError: no kernel" in md
    assert "Geomean x FlashQLA: 1.250 over 1 rows." in md
    # --ab: the same public call with one backward default changed, in its own table
    assert "`ours_per_value_head: bwd_dqkwg.KERNEL = 'blocked'`" in md and "| 16/32 | 8192x1 | 1.200 | 1.000 |" in md
    # --stages: labelled internal, one column a stage
    assert "Internal, not the user's number" in md and "| 16/32 | 8192x1 | 32 | 0.050 | 0.250 |" in md
    # the floor: three forwards' MMA work at 700 TFLOP/s
    assert bwd.floor_ms(16, 32, 8192, 1)[1] == pytest.approx(3 * 128 * 32 * bwd.fwd.FLOP_PER_CHUNK_HEAD / 700e12 * 1e3)


def test_backward_benchmark_rejects_an_unknown_ab_arm_in_one_line(capsys):
    with pytest.raises(SystemExit):
        _gdn_backward().main(["--ab", "ours_walk,ours_fast", "--precompile-only"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--ab names ['ours_fast']" in err and "ours_walk" in err


def test_backward_warm_up_reports_a_row_that_fails_instead_of_raising():
    # a worker that cannot run the row (here: no GPU, or no FlashQLA) names the row and its error; the run goes on
    err = _gdn_backward()._warm_flashqla_one((2, 4, 64, 1), False)
    assert err.startswith("(2, 4, 64, 1): ") and len(err) <= 300


def test_the_flashqla_fix_adds_the_pass_config_to_every_jit(monkeypatch):
    tilelang = pytest.importorskip("tilelang")
    seen = []
    monkeypatch.setattr(tilelang, "jit", lambda func=None, **kw: seen.append((func, kw)) or "jitted")
    _gdn_backward().force_qla_buffer_init_fix()
    tilelang.jit(out_idx=[1], pass_configs={"tl.disable_tma_lower": True})
    tilelang.jit(print)
    assert seen == [(None, {"out_idx": [1], "pass_configs": {"tl.disable_tma_lower": True,
                                                             "tl.disable_buffer_init_check": True}}),
                    (print, {"pass_configs": {"tl.disable_buffer_init_check": True}})]


def test_compile_all_names_each_failed_stage_spec(monkeypatch):
    """The shared precompile (``chunk_kernels.compile_all``, over ``toolkit.compile_many``) goes on past a failed
    kernel and reports it by its stage name and arguments."""
    pytest.importorskip("tilelang")  # the stage modules import it
    _gdn_forward()
    import chunk_kernels

    from flashqla_kernels import toolkit

    def compile_kernel(builder, *args):
        if args[0] == 2:
            raise RuntimeError("ptxas: too many registers")

    monkeypatch.setattr(toolkit, "compile_kernel", compile_kernel)
    specs = [("kkt_solve", (1, 2, 128, "bfloat16", False)), ("state_scan", (2, 128, 128, True))]
    assert chunk_kernels.compile_all(specs, 1) == [(("state_scan", (2, 128, 128, True)),
                                                    "RuntimeError: ptxas: too many registers")]


def test_forward_report_lists_each_librarys_kernels_under_the_stages():
    """--stages: each stage alone, then every kernel of one public call with its device time, ours and FlashQLA's
    (labelled internal), in the order the profile ranked them."""
    _gdn_forward()
    from gdn_forward_report import stages_markdown

    row = {"Hk": 16, "Hv": 32, "seqlen": 8192, "nseq": 4,
           "stages_ms": {"kkt_solve": 0.17, "cp": 0.0, "chunk_fwd": 0.49, "bDV": 128, "segment_chunks": 0},
           "kernels_ms": {"ours": {"gdn_chunk_fwd_kernel": 0.488, "gdn_kkt_solve_kernel": 0.169},
                          "flashqla": {"tilelang_fused_chunk_gdr_fwd_kernel_kernel": 0.405,
                                       "tilelang_kkt_solve_kernel_kernel": 0.226}}}
    text = "\n".join(stages_markdown({"rows": [row]}))
    assert "- 16/32 8192x4: 0.170 / 0.000 / 0.490 (128, 0)" in text
    assert "internal" in text
    assert "- 16/32 8192x4 ours (0.657): gdn_chunk_fwd_kernel 0.488, gdn_kkt_solve_kernel 0.169" in text
    assert "- 16/32 8192x4 flashqla (0.631): tilelang_fused_chunk_gdr_fwd_kernel_kernel 0.405" in text


def test_forward_report_says_when_another_process_loaded_the_host():
    """Each row records the host's load while it was timed; the report gives the range and names the rows timed on
    a shared host (the short rows are host-bound there)."""
    _gdn_forward()
    from gdn_forward_report import HOST_LOAD_SHARED, markdown

    def row(Hk, Hv, seqlen, load):
        return {"Hk": Hk, "Hv": Hv, "seqlen": seqlen, "nseq": 1, "ms": {"ours": 0.2, "flashqla": 0.3},
                "speedup_vs_fla": None, "ratio_vs_flashqla": 1.5, "anchor_fla_ms": 0.5, "anchor_flashqla_ms": 0.3,
                "bytes_floor_ms": 0.05, "flop_floor_ms": 0.06, "rel_l2_o_vs_ref": 2e-3, "rel_l2_state_vs_ref": 2e-3,
                "rel_l2_o_vs_fla": None, "host_load": load}

    result = {"gpu": "H100", "date": "d", "commit": "c", "versions": {}, "bf16_matmul_tflops": 778.0,
              "copy_tbps": 3.0, "method": "m", "geomean_speedup_vs_fla": None, "geomean_ratio_vs_flashqla": 1.5,
              "host_cpus": 16, "rows": [row(16, 32, 8192, 1.0), row(16, 16, 2048, HOST_LOAD_SHARED + 1.5)]}
    text = markdown(result)
    assert "Host load (1-minute average) while timing: 1.00-3.50 on 16 CPUs" in text
    assert "on 16/16 2048x1: the short rows there may be host-bound by it." in text
    result["rows"][1]["host_load"] = 1.2
    assert "1.00-1.20 on 16 CPUs." in markdown(result) and "host-bound by it" not in markdown(result)
