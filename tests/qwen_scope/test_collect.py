"""collect(): stored activations and codes equal a direct forward, packing, resume (a real SIGKILL), the CLI, re-runs
into a directory of another run, corpus globs, the recorded release."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hooks import capture
from qwen_scope.collect import collect, load_corpus, pack_rows
from qwen_scope.store import ActivationStore
from qwen_scope.store_writer import ShardWriter
from saes.loading import load
from tests.factories import tiny_model, tiny_tokenizer, write_sae_release

REPO = Path(__file__).resolve().parents[2]
WORDS = "the cat sat on a mat while seven quick foxes jumped over lazy dogs in gated delta rule land".split()


def write_corpus(path: Path, n_docs: int = 40, seed: int = 0) -> Path:
    """A jsonl corpus of ``n_docs`` documents of 1..30 words (some longer than a row, one empty)."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n_docs):
            n = int(torch.randint(1, 30, (1,), generator=g)) if i != 5 else 0
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=g)]
            f.write(json.dumps({"id": i, "text": " ".join(words)}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    return {"model": tiny_model("qwen3_5"), "tok": tiny_tokenizer(),
            "corpus": load_corpus(write_corpus(root / "corpus.jsonl")),
            "release": write_sae_release(root), "root": root}


def _rows(store: ActivationStore) -> list[tuple[int, int]]:
    """``(start, stop)`` of each packed row, from the stored positions (a row restarts at position 0)."""
    starts = torch.nonzero(store.positions() == 0).flatten().tolist() + [store.n_tokens]
    return list(zip(starts[:-1], starts[1:]))


def test_stored_activations_equal_a_direct_forward_of_each_row(setup, tmp_path):
    points = ["resid_post.1", "blocks.3.hook_resid_post", "attn_out.2", "mlp_out.0"]
    summary = collect(setup["model"], setup["corpus"], points=points, token_budget=600, context_len=32,
                      out_dir=tmp_path, batch_size=4, store_dtype=torch.float32, tokenizer=setup["tok"],
                      shard_tokens=256, progress=False)
    store = ActivationStore(tmp_path, verify=True)
    assert summary.n_tokens == store.n_tokens == 600 and summary.complete
    assert store.points == ["resid_post.1", "resid_post.3", "attn_out.2", "mlp_out.0"]
    assert store.manifest["padding_fraction"] == summary.padding_fraction < 32 / 632
    rows = _rows(store)
    assert [b - a for a, b in rows][:-1] == [32] * (len(rows) - 1)
    for a, b in rows[:3] + rows[-2:]:
        ids = store.token_ids()[a:b][None]
        with capture(setup["model"], store.points) as cap:
            setup["model"](input_ids=ids, use_cache=False)
        for p in store.points:
            torch.testing.assert_close(store.dense(p, a, b), cap[p][0], rtol=1e-5, atol=1e-5)


def test_on_step_reports_the_tokens_stored_after_every_step_and_can_stop_the_run(setup, tmp_path):
    seen = []
    summary = collect(setup["model"], setup["corpus"], points=["resid_post.1"], token_budget=300, context_len=32,
                      out_dir=tmp_path / "a", batch_size=4, tokenizer=setup["tok"], shard_tokens=256,
                      progress=False, on_step=seen.append)
    # steps of 4 rows x 32 tokens, the last one short: 128, 256, 300
    assert seen == [128, 256, 300] and summary.n_tokens == 300

    def stop(stored):
        if stored >= 256:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(setup["model"], setup["corpus"], points=["resid_post.1"], token_budget=300, context_len=32,
                out_dir=tmp_path / "b", batch_size=4, tokenizer=setup["tok"], shard_tokens=128, progress=False,
                on_step=stop)
    resumed = collect(setup["model"], setup["corpus"], points=["resid_post.1"], token_budget=300, context_len=32,
                      out_dir=tmp_path / "b", batch_size=4, tokenizer=setup["tok"], shard_tokens=128,
                      progress=False)
    assert resumed.n_tokens == 300 and resumed.n_tokens_this_run < 300
    torch.testing.assert_close(ActivationStore(tmp_path / "b").dense("resid_post.1", 0, 300),
                               ActivationStore(tmp_path / "a").dense("resid_post.1", 0, 300), rtol=0, atol=0)


def test_token_stream_is_the_corpus_concatenated_with_eos_and_doc_index_tracks_documents(setup, tmp_path):
    collect(setup["model"], setup["corpus"], points=["resid_post.0"], token_budget=500, context_len=32,
            out_dir=tmp_path, batch_size=3, tokenizer=setup["tok"], progress=False)
    store = ActivationStore(tmp_path)
    texts = setup["corpus"]["text"]
    stream, docs = [], []
    for i, t in enumerate(texts):
        ids = setup["tok"](t, add_special_tokens=False)["input_ids"] + [0]
        stream += ids
        docs += [i] * len(ids)
    assert store.token_ids().tolist() == stream[:500] and store.doc_index().tolist() == docs[:500]
    assert store.positions().tolist() == [i % 32 for i in range(500)]
    assert store.manifest["bos_policy"]["separator_id"] == 0 and store.dense("resid_post.0").dtype == torch.bfloat16


def test_stored_sae_codes_equal_encode_sparse(setup, tmp_path):
    collect(setup["model"], setup["corpus"], points=["resid_post.1"], sae_layers=[1, 3],
            release=str(setup["release"]), token_budget=300, context_len=32, out_dir=tmp_path, batch_size=4,
            store_dtype=torch.float32, tokenizer=setup["tok"], progress=False)
    store = ActivationStore(tmp_path)
    assert store.manifest["sae"]["layers"] == [1, 3] and store.manifest["sae"]["k"] == 8
    assert store.point_info("resid_post.3")["dense"] is False
    sae1, sae3 = (load(setup["release"], n) for n in (1, 3))
    codes = store.sae_codes("resid_post.1")
    want = sae1.encode_sparse(store.dense("resid_post.1"))
    assert torch.equal(codes.indices, want.indices) and torch.equal(codes.values, want.values)
    a, b = _rows(store)[2]
    with capture(setup["model"], ["resid_post.3"]) as cap:
        setup["model"](input_ids=store.token_ids()[a:b][None], use_cache=False)
    want3 = sae3.encode_sparse(cap["resid_post.3"][0])
    got3 = store.sae_codes("resid_post.3", a, b)
    assert torch.equal(got3.indices, want3.indices)
    torch.testing.assert_close(got3.values, want3.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(store.feature_acts("resid_post.3", a, b), sae3.encode(cap["resid_post.3"][0]),
                               rtol=1e-5, atol=1e-5)


def test_pack_rows_resumes_from_every_cursor_and_document_packing_pads(setup):
    docs = [(i, 10 * i, list(range(100 * i, 100 * i + n))) for i, n in enumerate([5, 0, 17, 3, 40, 1])]
    rows = list(pack_rows(docs, 8, separator_id=-1))
    flat = [t for r in rows for t in r.tokens]
    assert flat == [t for _, _, d in docs for t in d + [-1]] and all(len(r.tokens) == 8 for r in rows[:-1])
    for i, row in enumerate(rows[:-1]):
        rest = list(pack_rows([d for d in docs if d[0] >= row.cursor[0]], 8, separator_id=-1, start=row.cursor))
        assert rest == rows[i + 1:], i
    bos = list(pack_rows(docs, 8, separator_id=-1, prepend_bos_id=7))
    assert all(r.tokens[0] == 7 for r in bos) and bos[1].doc_index[0] == bos[1].doc_index[1]
    by_doc = list(pack_rows(docs, 8, packing="document"))
    assert [r.tokens for r in by_doc] == [d[:8] for _, _, d in docs if d] and by_doc[2].doc_index == [30] * 3


def test_document_packing_reports_its_padding(setup, tmp_path):
    summary = collect(setup["model"], setup["corpus"], points=["resid_post.2"], token_budget=400, context_len=64,
                      out_dir=tmp_path, batch_size=4, packing="document", tokenizer=setup["tok"], progress=False)
    store = ActivationStore(tmp_path)
    rows = _rows(store)
    assert summary.padding_fraction == pytest.approx(1 - 400 / (64 * len(rows)))
    assert store.manifest["n_pad"] == 64 * len(rows) - 400
    assert len(set(store.doc_index()[a].item() for a, _ in rows)) == len(rows)


def test_rerun_resumes_or_refuses_a_changed_config(setup, tmp_path):
    kw = dict(points=["resid_post.1"], context_len=32, out_dir=tmp_path, batch_size=2, tokenizer=setup["tok"],
              progress=False, shard_tokens=64)
    first = collect(setup["model"], setup["corpus"], token_budget=300, **kw)
    again = collect(setup["model"], setup["corpus"], token_budget=300, **kw)
    assert again.n_tokens == first.n_tokens == 300 and again.n_shards == first.n_shards
    with pytest.raises(ValueError, match="different collection.*token_budget"):
        collect(setup["model"], setup["corpus"], token_budget=400, **kw)
    with pytest.raises(ValueError, match="nothing to collect"):
        collect(setup["model"], setup["corpus"], token_budget=400, **{**kw, "points": None, "overwrite": True})


KILL_SCRIPT = """
import sys, time, torch
sys.path.insert(0, {repo!r})
from qwen_scope.collect import collect, load_corpus
from tests.factories import tiny_model, tiny_tokenizer
model = tiny_model("qwen3_5")
if {slow}:
    model.model.layers[0].register_forward_pre_hook(lambda *a: time.sleep(0.03))
collect(model, load_corpus({corpus!r}), points=["resid_post.1"], sae_layers=[2], release={release!r},
        token_budget=800, context_len=32, out_dir={out!r}, batch_size=2, shard_tokens=64,
        tokenizer=tiny_tokenizer(), progress=False)
"""


def _script(setup, out: Path, slow: bool) -> str:
    return textwrap.dedent(KILL_SCRIPT.format(repo=str(REPO), corpus=str(setup["root"] / "corpus.jsonl"),
                                              release=str(setup["release"]), out=str(out), slow=slow))


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_gives_exactly_the_uninterrupted_store(setup, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", _script(setup, killed, slow=True)], cwd=REPO)
    progress = killed / "rank000" / "progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.exists() and len(json.loads(progress.read_text())["shards"]) >= 3:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = json.loads(progress.read_text())
    assert proc.returncode == -signal.SIGKILL and not state["complete"] and 3 <= len(state["shards"]) < 13
    exec(compile(_script(setup, killed, slow=False), "resume", "exec"), {})
    # whatever temp file the kill left (in .tmp/, by design) the resumed writer swept
    assert not list((killed / ".tmp").iterdir()) and not list(killed.glob("rank000/.*tmp*"))
    exec(compile(_script(setup, whole, slow=False), "whole", "exec"), {})
    a, b = ActivationStore(killed, verify=True), ActivationStore(whole, verify=True)
    assert a.n_tokens == b.n_tokens == 800 and a.manifest["complete"]
    for get in (ActivationStore.token_ids, ActivationStore.doc_index, ActivationStore.positions):
        assert torch.equal(get(a), get(b))
    assert torch.equal(a.dense("resid_post.1"), b.dense("resid_post.1"))
    assert all(torch.equal(x, y) for x, y in zip(a.sae_codes("resid_post.2"), b.sae_codes("resid_post.2")))
    assert [s["sha256"] for s in a.shards] == [s["sha256"] for s in b.shards]


def test_cli_collect_writes_a_store(setup, tmp_path):
    from qwen_scope.cli import main

    model_dir = tmp_path / "tiny"
    setup["model"].save_pretrained(model_dir)
    setup["tok"].save_pretrained(model_dir)
    rc = main(["collect", str(model_dir), str(setup["root"] / "corpus.jsonl"), "--out", str(tmp_path / "acts"),
               "--points", "resid_post.0,resid_post.2", "--sae-layers", "1", "--release", str(setup["release"]),
               "--tokens", "200", "--context-len", "32", "--batch-size", "2", "--dtype", "float32", "--no-progress",
               "--gdn-kernels"])
    assert rc == 0
    store = ActivationStore(tmp_path / "acts")
    assert store.n_tokens == 200 and store.points == ["resid_post.0", "resid_post.2", "resid_post.1"]
    assert store.manifest["config"]["dtype"] == "float32"
    plain = tmp_path / "plain"
    assert main(["collect", str(model_dir), str(setup["root"] / "corpus.jsonl"), "--out", str(plain), "--points",
                 "resid_post.2", "--tokens", "200", "--context-len", "32", "--batch-size", "2", "--dtype", "float32",
                 "--no-progress", "--no-gdn-kernels"]) == 0
    # the fused layer's torch formulation (--gdn-kernels off Hopper) stores what transformers' layer computes
    torch.testing.assert_close(store.dense("resid_post.2"), ActivationStore(plain).dense("resid_post.2"),
                               rtol=1e-5, atol=2e-5)


def test_load_corpus_reads_local_jsonl_parquet_text_and_directories(tmp_path):
    import datasets

    rows = [{"text": f"document {i}"} for i in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("\n".join(r["text"] for r in rows) + "\n")
    assert load_corpus(tmp_path / "a.parquet")["text"] == [r["text"] for r in rows]
    assert load_corpus(tmp_path / "t")["text"] == [r["text"] for r in rows]
    streamed = load_corpus(tmp_path / "a.parquet", streaming=True)
    assert [r["text"] for r in streamed] == [r["text"] for r in rows]
    with pytest.raises(ValueError, match="one kind"):
        (tmp_path / "t" / "b.parquet").write_bytes((tmp_path / "a.parquet").read_bytes())
        load_corpus(tmp_path / "t")


def test_cli_token_counts_accept_suffixes():
    from qwen_scope.commands.collect import _count

    assert (_count("10M"), _count("1.5k"), _count("2_000"), _count("1B")) == (10**7, 1500, 2000, 10**9)


def test_a_missing_text_column_is_reported_from_the_prefetch_thread(setup, tmp_path):
    with pytest.raises(ValueError, match=r"no 'body' column \(columns: \['id', 'text'\]\)"):
        collect(setup["model"], setup["corpus"], points=["resid_post.0"], token_budget=64, context_len=32,
                out_dir=tmp_path, text_column="body", tokenizer=setup["tok"], progress=False)


@pytest.mark.gpu
def test_collect_on_cuda_in_bf16_matches_a_direct_capture_and_the_fused_encode(setup, tmp_path):
    from saes.fused import fused_encode

    model = tiny_model("qwen3_5", dtype=torch.bfloat16).cuda()
    sae = load(setup["release"], 2, device="cuda", dtype=torch.bfloat16)
    collect(model, setup["corpus"], points=["resid_post.2"], saes={2: sae}, token_budget=400, context_len=64,
            out_dir=tmp_path, batch_size=2, tokenizer=setup["tok"], progress=False)
    store = ActivationStore(tmp_path, verify=True)
    assert store.manifest["config"]["dtype"] == "bfloat16" and store.n_tokens == 400
    a, b = _rows(store)[1]
    with capture(model, ["resid_post.2"]) as cap:
        model(input_ids=store.token_ids()[a:b][None].cuda(), use_cache=False)
    torch.testing.assert_close(store.dense("resid_post.2", a, b).cuda(), cap["resid_post.2"][0], rtol=2e-2, atol=2e-2)
    want = fused_encode(store.dense("resid_post.2").cuda(), sae)
    got = store.sae_codes("resid_post.2")
    agree = (got.indices.cuda().sort(-1).values == want.indices.sort(-1).values).all(-1).float().mean()
    assert agree > 0.99


def test_overwrite_discards_rank_directories_of_an_earlier_run_with_more_ranks(tmp_path):
    # What a 2-rank torchrun leaves behind: rank001/ with its own progress file of another config.
    old = ShardWriter(tmp_path, {"earlier": "two-rank run"}, rank=1, world_size=2)
    old.write({"token_ids": torch.arange(3, dtype=torch.int32)}, n_rows=1, n_pad=0, cursor=[0, 0])
    old.finish({})
    docs = ["the cat sat on a mat"] * 8
    summary = collect(tiny_model("qwen3_5"), docs, points=["resid_post.1"], token_budget=40, context_len=8,
                      out_dir=tmp_path, tokenizer=tiny_tokenizer(), progress=False, overwrite=True)
    store = ActivationStore(tmp_path)
    assert summary.complete and summary.world_size == 1
    assert store.n_tokens == 40 and {s["rank"] for s in store.shards} == {0}
    assert not (tmp_path / "rank001").exists()


def test_load_corpus_reads_an_absolute_glob_and_names_an_empty_one(tmp_path):
    for name, text in (("a.jsonl", "first"), ("b.jsonl", "second")):
        (tmp_path / name).write_text(f'{{"text": "{text}"}}\n')
    # Path().glob refuses absolute patterns (NotImplementedError): the loader must not rely on it.
    assert load_corpus(str(tmp_path / "*.jsonl"))["text"] == ["first", "second"]
    with pytest.raises(FileNotFoundError, match=r"nothing-\*\.jsonl: the pattern matches no file"):
        load_corpus(str(tmp_path / "nothing-*.jsonl"))


@pytest.mark.parametrize("how", ["saes", "release"])
def test_the_store_records_a_release_that_loads_again(tmp_path, how):
    # `qwen-scope explore` loads the recorded release when --release is not given; for a local SAE-Res-... directory
    # an id derived from its name would not do: saes.load() does not know it.
    release_dir = write_sae_release(tmp_path / "rel")
    extra = {"saes": {1: load(release_dir, 1)}} if how == "saes" else {"sae_layers": [1], "release": str(release_dir)}
    collect(tiny_model("qwen3_5"), ["the cat sat on a mat"] * 4, token_budget=20, context_len=8,
            out_dir=tmp_path / "store", tokenizer=tiny_tokenizer(), progress=False, **extra)
    recorded = ActivationStore(tmp_path / "store").point_info("resid_post.1")["sae"]["release"]
    again = load(recorded, 1)
    assert torch.equal(again.W_enc, load(release_dir, 1).W_enc)


def test_a_second_collect_run_into_the_same_store_gets_one_error_naming_the_first(setup, tmp_path, capsys):
    from qwen_scope.cli import main
    from tests.qwen_scope.test_store_files import _holder

    out = tmp_path / "acts"
    proc = _holder(out)  # a run that holds the store's writer lock
    try:
        with pytest.raises(ValueError, match=rf"acts is being written by another collect run \(pid {proc.pid}"):
            collect(setup["model"], setup["corpus"], points=["resid_post.1"], token_budget=64, context_len=32,
                    out_dir=out, tokenizer=setup["tok"], progress=False)
        assert not (out / "rank000").exists()  # refused before anything was written
        model_dir = tmp_path / "tiny"
        setup["model"].save_pretrained(model_dir)
        setup["tok"].save_pretrained(model_dir)
        capsys.readouterr()
        assert main(["collect", str(model_dir), str(setup["root"] / "corpus.jsonl"), "--out", str(out),
                     "--points", "resid_post.1", "--tokens", "64", "--context-len", "32", "--no-progress"]) == 2
        err = _error_line(capsys.readouterr().err)
        assert f"pid {proc.pid}" in err
    finally:
        proc.kill()
        proc.wait()
    summary = collect(setup["model"], setup["corpus"], points=["resid_post.1"], token_budget=64, context_len=32,
                      out_dir=out, tokenizer=setup["tok"], progress=False)
    assert summary.complete and summary.n_tokens == 64


def _error_line(err: str) -> str:
    """The CLI's error, checked to be one line (whatever transformers printed before it)."""
    tail = err[err.index("qwen-scope collect: error: "):]
    assert tail.count("\n") == 1 and tail.endswith("\n"), tail
    return tail


def _shard_hashes(root: Path) -> dict[str, str]:
    from qwen_scope.store_files import file_sha256

    return {p.name: file_sha256(p) for p in sorted(root.glob("rank000/shard-*.safetensors"))}


def test_rerun_on_a_damaged_store_refuses_then_repair_recomputes_exactly_the_damaged_shards(setup, tmp_path):
    kw = dict(points=["resid_post.1"], sae_layers=[2], release=str(setup["release"]), token_budget=300,
              context_len=32, batch_size=2, shard_tokens=64, tokenizer=setup["tok"], progress=False)
    clean = collect(setup["model"], setup["corpus"], out_dir=tmp_path / "clean", **kw)
    want = _shard_hashes(tmp_path / "clean")
    assert clean.n_shards == 5 and len(want) == 5
    out = tmp_path / "damaged"
    shutil.copytree(tmp_path / "clean", out)
    shards = sorted(out.glob("rank000/shard-*.safetensors"))
    shards[1].unlink()
    shards[2].write_bytes(os.urandom(shards[2].stat().st_size))
    shards[4].write_bytes(shards[4].read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"3 recorded shard\(s\) are missing or damaged: rank000/shard-000001"
                                         r".*missing.*shard-000002.*sha256.*shard-000004.*bytes.*--repair"):
        collect(setup["model"], setup["corpus"], out_dir=out, **kw)
    repaired = collect(setup["model"], setup["corpus"], out_dir=out, repair=True, **kw)
    assert repaired.complete and repaired.n_tokens == 300 and repaired.n_tokens_this_run == 0
    assert repaired.n_tokens_repaired == 64 + 64 + 44 and "repaired 172 tokens" in str(repaired)
    assert _shard_hashes(out) == want  # byte for byte the uninterrupted run
    assert json.loads((out / "manifest.json").read_text())["shards"] == \
        json.loads((tmp_path / "clean" / "manifest.json").read_text())["shards"]
    ActivationStore(out).verify()


def test_a_repair_that_finds_other_rows_refuses(setup, tmp_path):
    kw = dict(points=["resid_post.1"], token_budget=200, context_len=32, batch_size=2, shard_tokens=64,
              tokenizer=setup["tok"], progress=False)
    collect(setup["model"], setup["corpus"], out_dir=tmp_path, **kw)
    progress = tmp_path / "rank000" / "progress.json"
    state = json.loads(progress.read_text())
    state["shards"][1]["cursor"] = [0, 0]  # the record no longer says where the corpus continues
    progress.write_text(json.dumps(state))
    (tmp_path / "rank000" / "shard-000002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard-000002.safetensors: the recomputed shard holds .* cannot be "
                                         r"repaired: rerun with --overwrite"):
        collect(setup["model"], setup["corpus"], out_dir=tmp_path, repair=True, **kw)


@pytest.mark.parametrize("bad, match", [
    ({"token_budget": 0}, r"token_budget \(--tokens\) must be a whole number >= 1, got 0"),
    ({"token_budget": -5}, r"token_budget \(--tokens\) must be .* got -5"),
    ({"batch_size": -1}, r"batch_size \(--batch-size\) must be .* got -1"),
    ({"batch_size": 0}, r"batch_size \(--batch-size\) must be .* got 0"),
    ({"context_len": 0}, r"context_len \(--context-len\) must be .* got 0"),
    ({"shard_tokens": 0}, r"shard_tokens \(--shard-tokens\) must be .* got 0"),
    ({"corpus": []}, r"the corpus list:[0-9a-f]+ yields no tokens: 0 document\(s\)"),
    ({"corpus": ["", "", ""]}, r"yields no tokens: 3 document\(s\), every one empty .* --text-column \('text'\)")])
def test_bad_settings_are_refused_before_anything_is_written(setup, tmp_path, bad, match):
    kw = dict(points=["resid_post.1"], token_budget=64, context_len=32, batch_size=2, tokenizer=setup["tok"],
              progress=False, out_dir=tmp_path / "acts")
    corpus = bad.pop("corpus", setup["corpus"])
    with pytest.raises(ValueError, match=match):
        collect(setup["model"], corpus, **{**kw, **bad})
    assert not list((tmp_path / "acts").glob("rank*/*.safetensors"))
    assert not (tmp_path / "acts" / "manifest.json").exists()


def test_cli_bad_settings_are_one_line_and_write_nothing(setup, tmp_path, capsys):
    from qwen_scope.cli import main

    model_dir = tmp_path / "tiny"
    setup["model"].save_pretrained(model_dir)
    setup["tok"].save_pretrained(model_dir)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a store")
    base = ["collect", str(model_dir), str(setup["root"] / "corpus.jsonl"), "--points", "resid_post.1",
            "--no-progress"]
    cases = [(["--out", str(tmp_path / "o"), "--tokens", "infK"], "--tokens expects a whole token count >= 1"),
             (["--out", str(tmp_path / "o"), "--tokens", "0"], "got '0'"),
             (["--out", str(tmp_path / "o"), "--tokens", "-5"], "got '-5'"),
             (["--out", str(tmp_path / "o"), "--tokens", "64", "--batch-size", "-1"], "batch_size (--batch-size)"),
             (["--out", str(tmp_path / "o"), "--tokens", "64", "--context-len", "0"], "context_len (--context-len)"),
             (["--out", str(a_file), "--tokens", "64"], f"--out) {a_file} is a file; expected a directory")]
    for args, needle in cases:
        capsys.readouterr()
        assert main(base + args) == 2, args
        err = _error_line(capsys.readouterr().err)
        assert needle in err, (args, err)
    assert not (tmp_path / "o").exists() and a_file.read_text() == "not a store"


def test_stored_indices_take_two_bytes_and_the_manifest_records_the_layout(setup, tmp_path):
    from safetensors import safe_open

    collect(setup["model"], setup["corpus"], sae_layers=[1], release=str(setup["release"]), token_budget=96,
            context_len=32, out_dir=tmp_path, batch_size=2, tokenizer=setup["tok"], progress=False)
    store = ActivationStore(tmp_path)
    assert store.point_info("resid_post.1")["sae"]["index_layout"] == "uint16" and store.manifest["version"] == 2
    with safe_open(str(tmp_path / store.shards[0]["file"]), framework="pt") as f:
        assert f.get_slice("sae.resid_post.1.indices").get_dtype() == "U16"
        assert f.get_slice("sae.resid_post.1.values").get_dtype() == "BF16"
    want = load(setup["release"], 1).encode_sparse(_direct(setup, store, "resid_post.1"))
    assert torch.equal(store.sae_codes("resid_post.1").indices, want.indices)


def _direct(setup, store: ActivationStore, point: str) -> torch.Tensor:
    """``point``'s activations of every stored token, from a forward of each packed row."""
    parts = []
    for a, b in _rows(store):
        with capture(setup["model"], [point]) as cap:
            setup["model"](input_ids=store.token_ids()[a:b][None], use_cache=False)
        parts.append(cap[point][0])
    return torch.cat(parts)
