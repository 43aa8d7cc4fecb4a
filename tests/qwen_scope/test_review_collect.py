"""Review findings in collect(): re-running into a directory that held more ranks; absolute corpus globs."""
from __future__ import annotations

import pytest
import torch

from qwen_scope.collect import collect
from qwen_scope.store import ActivationStore
from qwen_scope.store_writer import ShardWriter
from tests.factories import tiny_model, tiny_tokenizer


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
    from qwen_scope.collect import load_corpus

    for name, text in (("a.jsonl", "first"), ("b.jsonl", "second")):
        (tmp_path / name).write_text(f'{{"text": "{text}"}}\n')
    # Path().glob refused absolute patterns with NotImplementedError.
    assert load_corpus(str(tmp_path / "*.jsonl"))["text"] == ["first", "second"]
    with pytest.raises(FileNotFoundError, match=r"nothing-\*\.jsonl: the pattern matches no file"):
        load_corpus(str(tmp_path / "nothing-*.jsonl"))


@pytest.mark.parametrize("how", ["saes", "release"])
def test_the_store_records_a_release_that_loads_again(tmp_path, how):
    # `qwen-scope explore` loads the recorded release when --release is not given; for a local SAE-Res-... directory
    # the store used to record an id derived from its name, which saes.load() does not know.
    from saes.loading import load
    from tests.factories import write_sae_release

    release_dir = write_sae_release(tmp_path / "rel")
    extra = {"saes": {1: load(release_dir, 1)}} if how == "saes" else {"sae_layers": [1], "release": str(release_dir)}
    collect(tiny_model("qwen3_5"), ["the cat sat on a mat"] * 4, token_budget=20, context_len=8,
            out_dir=tmp_path / "store", tokenizer=tiny_tokenizer(), progress=False, **extra)
    recorded = ActivationStore(tmp_path / "store").point_info("resid_post.1")["sae"]["release"]
    again = load(recorded, 1)
    assert torch.equal(again.W_enc, load(release_dir, 1).W_enc)
