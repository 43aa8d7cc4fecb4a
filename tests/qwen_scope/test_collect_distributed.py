"""collect() under ``torchrun --nproc-per-node 2`` on CPU (gloo): documents split by rank, one merged manifest, a
rank killed mid-run or rank 0 killed inside the manifest merge whose rerun completes the store with nothing lost or
duplicated, and a rank that never arrives named in one line once the others have waited their timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hooks import capture
from qwen_scope.collect import load_corpus
from qwen_scope.store import ActivationStore
from tests.factories import tiny_model, tiny_tokenizer
from tests.qwen_scope.test_collect import write_corpus

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys, torch
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from qwen_scope.collect import collect, load_corpus
from tests.factories import tiny_model, tiny_tokenizer
kill_after = int(os.environ.get("KILL_RANK1_AFTER", "0"))
stall_after = int(os.environ.get("STALL_RANK1_AFTER", "0"))


def on_step(stored):
    # a hard crash of one rank mid-run (no cleanup, no exception handling): what a lost GPU or an OOM kill does
    if kill_after and int(os.environ["RANK"]) == 1 and stored >= kill_after:
        os.kill(os.getpid(), {sigkill})
    # a rank that stops making progress without dying (a hung device or filesystem)
    if stall_after and int(os.environ["RANK"]) == 1 and stored >= stall_after:
        import time
        time.sleep(120)


if os.environ.get("KILL_RANK0_IN_MERGE") and int(os.environ["RANK"]) == 0:
    # rank 0 dies while it writes the merged manifest: its temp file half written, nothing renamed
    import qwen_scope.store_writer as store_writer

    def dying_write(path, obj, **kw):
        if str(path).endswith("manifest.json"):
            tmp = os.path.join(os.path.dirname(path), ".tmp", "store-manifest.json.partial")
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            with open(tmp, "w") as f:
                f.write('{{"format": ')
            os.kill(os.getpid(), {sigkill})
        return real_write(path, obj, **kw)

    real_write, store_writer.atomic_write_json = store_writer.atomic_write_json, dying_write


summary = collect(tiny_model("qwen3_5"), load_corpus({corpus!r}), points=["resid_post.2"], token_budget=301,
                  context_len=32, out_dir={out!r}, batch_size=2, shard_tokens=64, store_dtype=torch.float32,
                  tokenizer=tiny_tokenizer(), progress=False, on_step=on_step)
assert not dist.is_initialized()
# One write() per line: the two ranks share the pipe and print() would interleave.
os.write(1, f"SUMMARY {{summary.world_size}} {{summary.n_tokens}} {{summary.complete}}\\n".encode())
"""


def _torchrun(tmp_path: Path, corpus_path: Path, out: Path, **env_extra) -> subprocess.CompletedProcess:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(repo=str(REPO), corpus=str(corpus_path), out=str(out),
                                                    sigkill=int(signal.SIGKILL))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **env_extra}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One clean two-rank run: (corpus path, store dir, the finished process); the fault tests' reference store."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    corpus_path, out = write_corpus(tmp / "corpus.jsonl"), tmp / "acts"
    return corpus_path, out, _torchrun(tmp, corpus_path, out)


@pytest.mark.slow
def test_two_process_torchrun_splits_documents_by_rank_and_rank0_merges_the_manifest(uninterrupted):
    corpus_path, out, proc = uninterrupted
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("SUMMARY 2 301 True") == 2

    store = ActivationStore(out, verify=True)
    manifest = store.manifest
    assert manifest["complete"] and manifest["world_size"] == 2 and store.n_tokens == 301
    rank_of = torch.tensor([s["rank"] for s in store.shards for _ in range(s["n_tokens"])])
    assert rank_of.tolist() == sorted(rank_of.tolist()) and int((rank_of == 0).sum()) == 151

    # Each rank's tokens are its documents (i % 2 == rank) concatenated with EOS, cut at its share of the budget.
    tok, texts = tiny_tokenizer(), load_corpus(corpus_path)["text"]
    for rank, share in ((0, 151), (1, 150)):
        stream, docs = [], []
        for i in range(rank, len(texts), 2):
            ids = tok(texts[i], add_special_tokens=False)["input_ids"] + [0]
            stream, docs = stream + ids, docs + [i] * len(ids)
        mine = rank_of == rank
        assert store.token_ids()[mine].tolist() == stream[:share]
        assert store.doc_index()[mine].tolist() == docs[:share]

    model = tiny_model("qwen3_5")
    starts = torch.nonzero(store.positions() == 0).flatten().tolist() + [store.n_tokens]
    for a, b in [(starts[0], starts[1]), (starts[5], starts[6]), (starts[-2], starts[-1])]:
        with capture(model, ["resid_post.2"]) as cap:
            model(input_ids=store.token_ids()[a:b][None], use_cache=False)
        torch.testing.assert_close(store.dense("resid_post.2", a, b), cap["resid_post.2"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_rank_killed_mid_run_then_the_same_command_completes_the_store_exactly(tmp_path, uninterrupted):
    # rank 1 dies after its second step (of three): usually with its first shard recorded and the second written
    # but not yet recorded, while torchrun stops rank 0 wherever it is
    corpus_path, want_dir, got_dir, killed = _faulty_run(tmp_path, uninterrupted, KILL_RANK1_AFTER="128")
    assert killed.returncode != 0, "rank 1 should have died"
    assert "SIGKILL" in killed.stderr and "rank      : 1" in killed.stderr
    assert not (got_dir / "manifest.json").exists() or not ActivationStore(got_dir, verify=False).manifest.get(
        "complete"), "a killed run must not leave a store marked complete"
    _rerun_gives_the_uninterrupted_store(tmp_path, corpus_path, got_dir, want_dir)


def _faulty_run(tmp_path: Path, uninterrupted, **fault) -> tuple[Path, Path, Path, subprocess.CompletedProcess]:
    """The clean run's corpus into a fresh store with ``fault`` in the ranks' environment: (corpus path, the clean
    store, the faulty run's store, its process)."""
    corpus_path, want_dir, proc = uninterrupted
    assert proc.returncode == 0
    got_dir = tmp_path / "faulty"
    return corpus_path, want_dir, got_dir, _torchrun(tmp_path, corpus_path, got_dir, **fault)


def _rerun_gives_the_uninterrupted_store(tmp_path: Path, corpus_path: Path, got_dir: Path, want_dir: Path) -> None:
    """The same command run again completes the store: nothing lost or duplicated (the same token rows in the same
    order and shards, with the same activations as the uninterrupted run's)."""
    resumed = _torchrun(tmp_path, corpus_path, got_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("SUMMARY 2 301 True") == 2
    want, got = ActivationStore(want_dir, verify=True), ActivationStore(got_dir, verify=True)
    assert got.n_tokens == want.n_tokens == 301 and got.manifest["complete"]
    assert torch.equal(got.token_ids(), want.token_ids()) and torch.equal(got.doc_index(), want.doc_index())
    assert torch.equal(got.positions(), want.positions())
    assert torch.equal(got.dense("resid_post.2", 0, 301), want.dense("resid_post.2", 0, 301))
    assert [s["n_tokens"] for s in got.shards] == [s["n_tokens"] for s in want.shards]


@pytest.mark.slow
def test_rank0_killed_inside_the_manifest_merge_then_the_same_command_completes_the_store(tmp_path, uninterrupted):
    corpus_path, want_dir, got_dir, killed = _faulty_run(tmp_path, uninterrupted, KILL_RANK0_IN_MERGE="1")
    assert killed.returncode != 0 and "rank      : 0" in killed.stderr, killed.stderr[-2000:]
    assert not (got_dir / "manifest.json").exists()  # every shard recorded, no manifest
    assert list((got_dir / ".tmp").glob("*.partial"))
    _rerun_gives_the_uninterrupted_store(tmp_path, corpus_path, got_dir, want_dir)
    assert not list((got_dir / ".tmp").glob("*"))  # the next writer swept the half-written manifest


@pytest.mark.slow
def test_a_rank_that_stops_arriving_is_named_by_rank0_then_a_rerun_completes_the_store(tmp_path, uninterrupted):
    """Rank 1 hangs mid-run without dying: rank 0 finishes its share, waits QWEN_SCOPE_DIST_TIMEOUT_S at the end of
    collection, and stops with one line naming rank 1 and where it did not arrive; the same command then completes
    the store."""
    corpus_path, want_dir, got_dir, stalled = _faulty_run(tmp_path, uninterrupted, STALL_RANK1_AFTER="128",
                                                          QWEN_SCOPE_DIST_TIMEOUT_S="8")
    assert stalled.returncode != 0
    lines = [ln for ln in stalled.stderr.splitlines() if "RankTimeoutError:" in ln]
    assert lines and all("RankTimeoutError: rank(s) 1 of 2 did not reach the end of collection (every rank's last "
                         "shard recorded) within 8 s" in ln and "QWEN_SCOPE_DIST_TIMEOUT_S" in ln for ln in lines), \
        stalled.stderr[-3000:]
    _rerun_gives_the_uninterrupted_store(tmp_path, corpus_path, got_dir, want_dir)


def test_the_timeout_setting_is_checked_with_a_message_that_says_what_it_wants(monkeypatch):
    from qwen_scope.collect import _dist_timeout, _Ranks

    monkeypatch.setenv("QWEN_SCOPE_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="QWEN_SCOPE_DIST_TIMEOUT_S='soon': expected the seconds a rank waits"):
        _dist_timeout()
    monkeypatch.setenv("QWEN_SCOPE_DIST_TIMEOUT_S", "90")
    assert _dist_timeout().total_seconds() == 90
    # one rank: no group, nothing to wait for
    ranks = _Ranks(0, 1)
    ranks.wait("anything")
    assert ranks.broadcast("x") == "x"
