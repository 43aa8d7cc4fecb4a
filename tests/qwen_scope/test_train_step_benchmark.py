"""benchmarks/train_step.py on CPU: a tiny dry run of the arms that exist here writes the JSON and the table, and the
one missing here (FlashQLA's op) is a row naming why (the H200 run is a device phase; no timing is asserted)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_tiny_dry_run_trains_through_finetune_on_every_arm_it_can(tmp_path):
    import train_step

    train_step.main(["--tiny", "--out", str(tmp_path), "--steps", "2", "--profile"])
    result = json.loads((tmp_path / "train_step.json").read_text())
    arms = {r["arm"]: r for r in result["arms"]}
    assert set(arms) == {"transformers", "flashqla", "ours"}
    for name in ("transformers", "ours"):
        # trained without error; a tiny model's step may hide in the timer's noise, which the row then says
        assert "error" not in arms[name], arms[name]
        assert arms[name].get("tokens_per_s", 1) > 0 and ("tokens_per_s" in arms[name] or "note" in arms[name])
    assert "flash_qla" in arms["flashqla"]["error"]
    assert (result["batch"], result["micro"], result["seq_len"]) == (2, 1, 64)
    assert "| ours |" in (tmp_path / "train_step.md").read_text()
    # --profile: one training step's time by kind of op per arm that ran, in the JSON and the table
    for name in ("transformers", "ours"):
        prof = arms[name]["profile"]
        assert prof["total_ms"] > 0 and abs(sum(prof["ms"].values()) - prof["total_ms"]) <= 1e-6 * prof["total_ms"]
        assert prof["ms"].get("GEMM", 0) > 0 and prof["top_kernels"]
    assert "One training step profiled" in (tmp_path / "train_step.md").read_text()


def test_precompile_builds_the_kernels_of_the_2b_layer_as_the_fused_layer_trains_it(monkeypatch):
    """``--precompile-only`` asks for the forward chunk kernels and every backward kernel of the 2B GDN layer as the
    "ours" arm trains it (bf16, the l2norm in the glue, no states), the LM loss's kernels, and the whole-model
    benchmark's list (the glue's
    forward and backward kernels, the held-out evaluations' forward), without a GPU; it returns the failures."""
    import chunk_kernels
    import layer_kernels
    import train_step

    from flashqla_kernels import toolkit
    from flashqla_kernels.gated_delta_rule.hopper import backward

    built, compiled, layer = [], [], []
    monkeypatch.setattr(chunk_kernels, "compile_all", lambda specs, workers: built.extend(specs) or [])
    monkeypatch.setattr(toolkit, "compile_kernel", lambda builder, *args: compiled.append((builder, args)))
    monkeypatch.setattr(layer_kernels, "precompile", lambda jobs: layer.append(jobs) or 0)
    assert train_step.precompile(2) == 0
    assert {s[0] for s in built} >= {"kkt_solve", "chunk_fwd"}
    assert all(s[1][:3] == (16, 16, 128) for s in built if s[0] not in ("state_scan", "layout"))
    # the layout pass of channels-first q, k, v: 16 heads of 128 channels each for q / k and for v
    assert all(s[1] == (2048, 2048, "bfloat16") for s in built if s[0] == "layout")
    assert all(s[1][-1] is False for s in built if s[0] == "kkt_solve")  # no l2norm in the op
    from flashqla_kernels.decoder.hopper import cross_entropy

    # every backward kernel, and the LM loss's cross entropy and scale over the 2B vocabulary's bf16 logits
    want = backward.kernel_specs(16, 16, 128, 128, "bfloat16", False, False, False) + [
        (cross_entropy.build_cross_entropy, (248320, "bfloat16")), (cross_entropy.build_scale, (248320, "bfloat16"))]
    assert set(compiled) == set(want) and len(compiled) == len(set(want))  # each once
    assert layer == [1]
    names = {args[1] for args in layer_kernels.kernel_specs()}
    assert {"build_conv_qkv_gates_bwd", "build_gated_rms_norm_bwd", "build_rms_norm_bwd", "build_silu_mul_bwd"} <= names


def test_ours_torch_glue_arm_turns_the_glue_backward_kernels_off_for_its_run_only():
    import train_step

    from flashqla_kernels import is_patched
    from flashqla_kernels.decoder import ops

    assert ops.GRAD_KERNELS and not is_patched()
    with train_step.arm_context("ours_torch_glue"):
        assert not ops.GRAD_KERNELS and is_patched()
    with train_step.arm_context("ours"):
        assert ops.GRAD_KERNELS and is_patched()
    assert ops.GRAD_KERNELS and not is_patched()
    assert train_step.default_micro() == 2  # no GPU here: the documented default
