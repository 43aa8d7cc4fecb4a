"""collect() under ``torchrun --nproc-per-node 2`` on CPU (gloo): documents split by rank, one merged manifest, and a
rank killed mid-run whose rerun completes the store with nothing lost or duplicated."""
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


def on_step(stored):
    # a hard crash of one rank mid-run (no cleanup, no exception handling): what a lost GPU or an OOM kill does
    if kill_after and int(os.environ["RANK"]) == 1 and stored >= kill_after:
        os.kill(os.getpid(), {sigkill})


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


@pytest.mark.slow
def test_two_process_torchrun_splits_documents_by_rank_and_rank0_merges_the_manifest(tmp_path):
    corpus_path, out = write_corpus(tmp_path / "corpus.jsonl"), tmp_path / "acts"
    proc = _torchrun(tmp_path, corpus_path, out)
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
def test_a_rank_killed_mid_run_then_the_same_command_completes_the_store_exactly(tmp_path):
    corpus_path = write_corpus(tmp_path / "corpus.jsonl")
    want_dir, got_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    assert _torchrun(tmp_path, corpus_path, want_dir).returncode == 0
    # rank 1 dies after its second step (of three): usually with its first shard recorded and the second written
    # but not yet recorded, while torchrun stops rank 0 wherever it is
    killed = _torchrun(tmp_path, corpus_path, got_dir, KILL_RANK1_AFTER="128")
    assert killed.returncode != 0, "rank 1 should have died"
    assert "SIGKILL" in killed.stderr and "rank      : 1" in killed.stderr
    assert not (got_dir / "manifest.json").exists() or not ActivationStore(got_dir, verify=False).manifest.get(
        "complete"), "a killed run must not leave a store marked complete"
    resumed = _torchrun(tmp_path, corpus_path, got_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("SUMMARY 2 301 True") == 2

    want, got = ActivationStore(want_dir, verify=True), ActivationStore(got_dir, verify=True)
    assert got.n_tokens == want.n_tokens == 301 and got.manifest["complete"]
    # nothing lost or duplicated: the same token rows in the same order, with the same activations
    assert torch.equal(got.token_ids(), want.token_ids()) and torch.equal(got.doc_index(), want.doc_index())
    assert torch.equal(got.positions(), want.positions())
    assert torch.equal(got.dense("resid_post.2", 0, 301), want.dense("resid_post.2", 0, 301))
    assert [s["n_tokens"] for s in got.shards] == [s["n_tokens"] for s in want.shards]
