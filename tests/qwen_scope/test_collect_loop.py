"""The collection loop: steps are finished one step behind (the GPU is never waited for before the next launch), an
encode that reports an overflow is recomputed exactly, shard-writer errors surface and lose nothing, and the GDN
layers run on the fused layer for the call only."""
from __future__ import annotations

import pytest
import torch

import flashqla_kernels
from qwen_scope import collect_loop
from qwen_scope.collect import collect
from qwen_scope.store import ActivationStore
from qwen_scope.store_writer import ShardWriter
from saes.loading import load
from saes.topk import SparseCodes
from tests.factories import tiny_model
from tests.qwen_scope.test_collect import setup  # noqa: F401  (module fixture: model, tokenizer, corpus, release)

KW = dict(context_len=32, batch_size=2, progress=False)


def test_each_step_is_finished_after_the_next_one_is_launched(setup, tmp_path, monkeypatch):  # noqa: F811
    calls = []
    launch, finish = collect_loop.launch, collect_loop.finish

    def spy_launch(adapter, batch, *args):
        calls.append(("launch", batch.n_tokens))
        return launch(adapter, batch, *args)

    def spy_finish(step, *args):
        calls.append(("finish", step.batch.n_tokens))
        return finish(step, *args)

    monkeypatch.setattr(collect_loop, "launch", spy_launch)
    monkeypatch.setattr(collect_loop, "finish", spy_finish)
    collect(setup["model"], setup["corpus"], points=["resid_post.1"], token_budget=200, out_dir=tmp_path,
            tokenizer=setup["tok"], **KW)
    kinds = [k for k, _ in calls]
    n = kinds.count("launch")
    assert n == 4 and kinds == ["launch"] + ["launch", "finish"] * (n - 1) + ["finish"]
    assert sum(t for k, t in calls if k == "finish") == 200


def test_an_encode_overflow_is_recomputed_exactly_from_the_kept_activations(setup, tmp_path, monkeypatch):  # noqa: F811
    """fused_encode_async reports rows it could not certify in place; the step's codes are then recomputed."""
    flagged = []

    def overflowing(sae):
        def encode(x):
            wrong = SparseCodes(torch.zeros(x.shape[0], sae.k, dtype=x.dtype),
                                torch.arange(sae.k).expand(x.shape[0], -1).contiguous())
            flagged.append(x.shape[0])
            return wrong, torch.tensor(len(flagged) % 2 == 1)  # every other step overflows

        return encode

    monkeypatch.setattr(collect_loop, "encoder", overflowing)
    collect(setup["model"], setup["corpus"], points=["resid_post.1"], sae_layers=[1], release=str(setup["release"]),
            token_budget=256, out_dir=tmp_path, store_dtype=torch.float32, tokenizer=setup["tok"], **KW)
    store = ActivationStore(tmp_path)
    want = load(setup["release"], 1).encode_sparse(store.dense("resid_post.1"))
    codes = store.sae_codes("resid_post.1")
    overflowed = torch.cat([torch.full((n,), i % 2 == 0) for i, n in enumerate(flagged)])
    assert len(flagged) == 4 and overflowed.sum() == 128
    assert torch.equal(codes.indices[overflowed], want.indices[overflowed])
    assert torch.equal(codes.values[overflowed], want.values[overflowed])
    assert (codes.values[~overflowed] == 0).all()  # the steps without overflow keep what the encoder returned


def test_a_shard_write_error_stops_the_run_and_a_rerun_completes_the_store(setup, tmp_path, monkeypatch):  # noqa: F811
    kw = dict(points=["resid_post.2"], token_budget=320, out_dir=tmp_path, tokenizer=setup["tok"], shard_tokens=64,
              **KW)
    write, writes = ShardWriter.write, []

    def failing(self, tensors, **kw_):
        writes.append(1)
        if len(writes) == 3:
            raise OSError(28, "No space left on device")
        return write(self, tensors, **kw_)

    monkeypatch.setattr(ShardWriter, "write", failing)
    with pytest.raises(OSError, match="No space left"):
        collect(setup["model"], setup["corpus"], **kw)
    monkeypatch.setattr(ShardWriter, "write", write)
    resumed = collect(setup["model"], setup["corpus"], **kw)
    clean = collect(setup["model"], setup["corpus"], **{**kw, "out_dir": tmp_path / "clean"})
    assert resumed.n_tokens == clean.n_tokens == 320 and resumed.n_tokens_this_run == 320 - 128
    a, b = ActivationStore(tmp_path, verify=True), ActivationStore(tmp_path / "clean")
    assert torch.equal(a.token_ids(), b.token_ids()) and torch.equal(a.dense("resid_post.2"), b.dense("resid_post.2"))


def test_gdn_layers_run_fused_for_the_call_only(setup, tmp_path):  # noqa: F811
    kw = dict(points=["resid_post.3"], token_budget=160, tokenizer=setup["tok"], store_dtype=torch.float32, **KW)
    fused = collect(setup["model"], setup["corpus"], out_dir=tmp_path / "fused", gdn_kernels=True, **kw)
    assert not flashqla_kernels.is_patched()
    plain = collect(setup["model"], setup["corpus"], out_dir=tmp_path / "plain", gdn_kernels=False, **kw)
    auto = collect(setup["model"], setup["corpus"], out_dir=tmp_path / "auto", **kw)
    assert fused.gdn == "fused layer (flashqla_kernels)" and plain.gdn == "as loaded (gdn_kernels=False)"
    assert auto.gdn.startswith("transformers' own path (fused kernels need a Hopper GPU; cpu)")
    a, b = ActivationStore(tmp_path / "fused"), ActivationStore(tmp_path / "plain")
    torch.testing.assert_close(a.dense("resid_post.3"), b.dense("resid_post.3"), rtol=1e-5, atol=2e-5)
    with flashqla_kernels.patched_transformers():
        mine = collect(setup["model"], setup["corpus"], out_dir=tmp_path / "mine", **kw)
        assert flashqla_kernels.is_patched()
    assert mine.gdn == "as patched by the caller (flashqla_kernels)"
    with pytest.raises(ValueError, match="'qwen3' models have no Gated DeltaNet layers"):
        collect(tiny_model("qwen3"), setup["corpus"], out_dir=tmp_path / "q3", gdn_kernels=True, **kw)


def test_padded_batches_store_exactly_the_real_tokens(setup, tmp_path):  # noqa: F811
    """Document packing pads every row: the real tokens are gathered by a host-built index (no device-side mask)."""
    from hooks import capture

    collect(setup["model"], setup["corpus"], points=["resid_post.2"], token_budget=200, out_dir=tmp_path,
            packing="document", store_dtype=torch.float32, tokenizer=setup["tok"], context_len=16, batch_size=3,
            progress=False)
    store = ActivationStore(tmp_path)
    starts = torch.nonzero(store.positions() == 0).flatten().tolist() + [store.n_tokens]
    assert len(starts) > 6 and store.n_tokens == 200
    for a, b in zip(starts[:-1], starts[1:]):
        with capture(setup["model"], ["resid_post.2"]) as cap:
            setup["model"](input_ids=store.token_ids()[a:b][None], use_cache=False)
        torch.testing.assert_close(store.dense("resid_post.2", a, b), cap["resid_post.2"][0], rtol=1e-5, atol=1e-5)


def test_copy_out_hands_back_host_copies_and_no_event_on_cpu():
    """On CPU the step's results are the tensors themselves (contiguous) and nothing is waited for; on CUDA they go
    through the copy stream (covered by the GPU collection benchmark's stored-equals-direct checks)."""
    t = torch.arange(12.0).reshape(3, 4).t()
    host, event = collect_loop.copy_out(torch.device("cpu"), {"a": t, "b": torch.ones(2, dtype=torch.int32)})
    assert event is None and set(host) == {"a", "b"}
    assert host["a"].is_contiguous() and torch.equal(host["a"], t) and torch.equal(host["b"], torch.ones(2).int())
