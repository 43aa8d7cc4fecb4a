"""The collection benchmark scripts (benchmarks/collect_throughput.py, collect_profile.py) on CPU: their arithmetic,
and a dry run of the profile on a tiny model (the GPU run is a device phase of benchmarks/h200.sh)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_gpu_busy_time_is_the_union_of_overlapping_intervals():
    import collect_profile

    # us in, ms out: [0, 10) and [5, 20) overlap to 20 us; [30, 31) adds 1; a contained interval adds nothing
    assert collect_profile._union_ms([(5.0, 20.0), (0.0, 10.0), (30.0, 31.0), (6.0, 7.0)]) == pytest.approx(0.021)
    assert collect_profile._union_ms([]) == 0.0


def _op(name, start, end, thread=1, stack=()):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                           stack=list(stack))


def test_steady_window_and_copy_sites_come_from_the_step_marks():
    """The steady window runs from the second to the last step launch; each copy is named by the innermost
    enclosing op with a Python stack (repository frames only), per step of the window."""
    import collect_profile

    root = str(REPO)
    mark = collect_profile.STEP_MARK
    ops = [_op(mark, 0, 10), _op(mark, 100, 110), _op(mark, 200, 210), _op(mark, 300, 310)]
    assert collect_profile._steady_window(ops) == (100, 300, 2)
    assert collect_profile._steady_window(ops[:2]) is None
    frames = [f"{root}/saes/fused.py(42): f", "/x/site-packages/torch/a.py(1): g", f"{root}/q.py(7): h"]
    ops += [_op("aten::copy_", 120, 130, stack=frames), _op("aten::to", 119, 131, stack=frames[1:]),
            _op("cudaMemcpyAsync", 121, 129), _op("cudaMemcpyAsync", 221, 223), _op("cudaMemcpyAsync", 20, 21),
            _op("aten::copy_", 220, 224, thread=2, stack=frames)]
    sites = collect_profile._memcpy_sites(ops, 100, 300, 2, root)
    assert sites == [{"site": "aten::copy_ @ saes/fused.py(42): f <- q.py(7): h", "count": 0.5,
                      "host_ms": pytest.approx(0.004), "max_ms": pytest.approx(0.008)},
                     {"site": "(no enclosing op)", "count": 0.5, "host_ms": pytest.approx(0.001),
                      "max_ms": pytest.approx(0.002)}]


@pytest.mark.slow
def test_profile_dry_run_reports_both_arms(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "collect_profile.py"), "--tiny", "--steps", "2",
                          "--out", str(tmp_path), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "collect_profile.json").read_text())
    assert set(result["arms"]) == {"a: bare forward", "c1: collect, SAE codes at one layer"}
    for arm in result["arms"].values():
        assert arm["wall_ms_per_step"] > 0 and "aten::" in arm["top_host_ops"]
    assert "## c1: collect, SAE codes at one layer" in (tmp_path / "collect_profile.md").read_text()
    assert not (tmp_path / "work").exists()  # the profile's store is removed


def test_steady_step_is_the_mean_step_interval_of_a_call_timed_step_by_step(tmp_path, monkeypatch):
    """collect_arm's steady ms/step comes from one more call timed step by step (``on_step``): the call's set-up,
    its first step and its drain (here 0.2 s, 0.1 s and 0.3 s) stay out of it, and an uneven step (a shard write)
    stays in the mean."""
    import time as time_mod

    import qwen_scope.collect  # noqa: F401  (loads the module; the package's attribute is the verb)

    qc = sys.modules["qwen_scope.collect"]  # the module (the package exports the function by that name)

    sys.path.insert(0, str(REPO / "benchmarks"))
    import collect_throughput as ct

    calls = []

    def fake_collect(model, docs, token_budget, out_dir, on_step=None, **kw):
        steps = token_budget // (ct.B * ct.T)
        calls.append((steps, on_step is not None))
        time_mod.sleep(0.2)  # set-up
        for i in range(steps):
            time_mod.sleep(0.1 if i == 0 else 0.05 if i == 3 else 0.02)
            if on_step is not None:
                on_step((i + 1) * ct.B * ct.T)
        time_mod.sleep(0.3)  # drain
        return type("Summary", (), {"n_tokens": token_budget, "bytes": 0, "n_shards": steps})()

    monkeypatch.setattr(qc, "collect", fake_collect)
    monkeypatch.setattr(ct, "sync", lambda: None)
    per_step, info = ct.collect_arm(None, [], tmp_path, 2, steady_steps=4)
    assert calls == [(1, False), (2, False), (6, True)]
    # intervals after the second step: 0.02, 0.05, 0.02, 0.02
    assert abs(info["steady_s_per_step"] - 0.0275) < 0.008, info
    assert len(info["step_arrivals_s"]) == 6
    assert per_step > 0.3  # end to end: the set-up and the drain are in it
