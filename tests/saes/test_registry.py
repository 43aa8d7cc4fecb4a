"""The release table: 14 sets with the reference's numbers, consistent sizes, lookups and repo-id parsing."""
from __future__ import annotations

import pytest

from saes import get_release, list_releases, parse_repo_id

# From shared/reference/qwen-scope-saes.md §1.1: repo -> (layers, d_model, d_sae, k, per-file GB, repo total GB).
REFERENCE = {
    "SAE-Res-Qwen3-1.7B-Base-W32K-L0_50": (28, 2048, 32768, 50, 0.537, 15.0),
    "SAE-Res-Qwen3-1.7B-Base-W32K-L0_100": (28, 2048, 32768, 100, 0.537, 15.0),
    "SAE-Res-Qwen3-8B-Base-W64K-L0_50": (36, 4096, 65536, 50, 2.15, 77),
    "SAE-Res-Qwen3-8B-Base-W64K-L0_100": (36, 4096, 65536, 100, 2.15, 77),
    "SAE-Res-Qwen3.5-2B-Base-W32K-L0_50": (24, 2048, 32768, 50, 0.537, 12.9),
    "SAE-Res-Qwen3.5-2B-Base-W32K-L0_100": (24, 2048, 32768, 100, 0.537, 12.9),
    "SAE-Res-Qwen3.5-9B-Base-W64K-L0_50": (32, 4096, 65536, 50, 2.15, 69),
    "SAE-Res-Qwen3.5-9B-Base-W64K-L0_100": (32, 4096, 65536, 100, 2.15, 69),
    "SAE-Res-Qwen3.5-27B-W80K-L0_50": (64, 5120, 81920, 50, 3.36, 215),
    "SAE-Res-Qwen3.5-27B-W80K-L0_100": (64, 5120, 81920, 100, 3.36, 215),
    "SAE-Res-Qwen3-30B-A3B-Base-W32K-L0_50": (48, 2048, 32768, 50, 0.537, 25.8),
    "SAE-Res-Qwen3-30B-A3B-Base-W128K-L0_100": (48, 2048, 131072, 100, 2.15, 103),
    "SAE-Res-Qwen3.5-35B-A3B-Base-W32K-L0_50": (40, 2048, 32768, 50, 0.537, 21.5),
    "SAE-Res-Qwen3.5-35B-A3B-Base-W128K-L0_100": (40, 2048, 131072, 100, 2.15, 86),
}


def test_fourteen_sets_with_the_reference_numbers():
    releases = list_releases()
    assert len(releases) == 14 and len({r.id for r in releases}) == 14
    assert {r.repo_id for r in releases} == {f"Qwen/{name}" for name in REFERENCE}
    for r in releases:
        layers, d_model, d_sae, k, _, _ = REFERENCE[r.repo_id.split("/")[1]]
        assert (r.n_layers, r.d_model, r.d_sae, r.k) == (layers, d_model, d_sae, k), r.id
        assert r.registered and r.expansion in (16, 64)
    assert sum(r.n_layers for r in releases) == 544


def test_sizes_are_consistent_with_the_reference():
    for r in list_releases():
        _, d_model, d_sae, _, file_gb, total_gb = REFERENCE[r.repo_id.split("/")[1]]
        assert r.file_bytes == 4 * (2 * d_model * d_sae + d_sae + d_model)
        assert r.total_bytes == r.n_layers * r.file_bytes
        assert r.file_bytes / 1e9 == pytest.approx(file_gb, rel=0.01), r.id
        assert r.total_bytes / 1e9 == pytest.approx(total_gb, rel=0.01), r.id


def test_k_and_width_agree_with_the_repo_name_and_sae_lens_id():
    for r in list_releases():
        parsed = parse_repo_id(r.repo_id)
        assert (parsed.id, parsed.k, parsed.d_sae, parsed.model_id, parsed.trained_on) == \
            (r.id, r.k, r.d_sae, r.model_id, r.trained_on)
        assert r.id.endswith(f"-w{r.d_sae // 1024}k-l{r.k}")


def test_only_the_27b_sets_are_instruct_trained():
    instruct = list_releases(trained_on="instruct")
    assert [r.id for r in instruct] == ["qwen-scope-3.5-27b-w80k-l50", "qwen-scope-3.5-27b-w80k-l100"]
    assert all(r.model_id == "Qwen/Qwen3.5-27B" for r in instruct)
    assert all(r.model_id.endswith("-Base") for r in list_releases(trained_on="base"))
    assert [r.k for r in list_releases(model="qwen3.5-2b")] == [50, 100]


@pytest.mark.parametrize("name", ["qwen-scope-3.5-2b-base-w32k-l100", "Qwen/SAE-Res-Qwen3.5-2B-Base-W32K-L0_100",
                                  "SAE-Res-Qwen3.5-2B-Base-W32K-L0_100", "QWEN-SCOPE-3.5-2B-BASE-W32K-L100"])
def test_lookup_by_release_id_or_repo_id(name):
    r = get_release(name)
    assert r.id == "qwen-scope-3.5-2b-base-w32k-l100" and r.registered
    assert (r.d_model, r.d_sae, r.k, r.n_layers) == (2048, 32768, 100, 24)
    assert r.filename(12) == "layer12.sae.pt"


def test_unregistered_repo_ids_are_parsed_with_k_from_the_name():
    r = get_release("someone/SAE-Res-Qwen3-8B-Base-W16K-L0_32")
    assert not r.registered
    assert (r.k, r.d_sae, r.trained_on, r.model_id) == (32, 16384, "base", "someone/Qwen3-8B-Base")
    assert (r.d_model, r.n_layers) == (4096, 36)  # known model: sizes from the table
    assert r.id == "qwen-scope-3-8b-base-w16k-l32"
    nano = parse_repo_id("SAE-Res-Qwen3.5-Nano-Base-W0K-L0_8")
    assert (nano.k, nano.d_sae, nano.d_model, nano.n_layers, nano.file_bytes) == (8, None, None, None, None)
    assert parse_repo_id("Qwen/SAE-Res-Qwen3.5-27B-W80K-L0_100").trained_on == "instruct"


@pytest.mark.parametrize("repo", ["Qwen/SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16", "Qwen/SAE-Res-Qwen4-35B-A3B-W64K-L0_50",
                                  "Qwen/SAE-Res-Qwen3.5-0.8B-Base-W16K-L0_50"])
def test_ids_derived_for_unregistered_sets_resolve_back(repo):
    r = parse_repo_id(repo)
    back = get_release(r.id)
    assert back == r and back.repo_id == repo and not back.registered


def test_unknown_ids_and_layers_raise_helpful_errors():
    with pytest.raises(ValueError, match="Did you mean qwen-scope-3.5-2b-base-w32k-l100"):
        get_release("qwen-scope-3.5-2b-base-w32k-l10")
    with pytest.raises(ValueError, match="expected 'Qwen/SAE-Res-<model>-W<N>K-L0_<k>'"):
        parse_repo_id("Qwen/SAE-Res-Qwen3-8B")
    r = get_release("qwen-scope-3.5-2b-base-w32k-l100")
    assert r.check_layer(23) == 23
    with pytest.raises(ValueError, match="valid layers are 0..23"):
        r.check_layer(24)
    # sae-lens names an SAE of a release "layer12": accepted wherever a layer is asked.
    assert r.check_layer("layer3") == 3 and r.check_layer("3") == 3
    with pytest.raises(ValueError, match="valid layers are 0..23"):
        r.check_layer("layer24")
    for bad in ("three", 3.0, True):
        with pytest.raises(TypeError, match="sae-lens SAE id like 'layer12'"):
            r.check_layer(bad)


def test_model_mismatch_notes_base_instruct_and_foreign_models():
    r = get_release("qwen-scope-3.5-2b-base-w32k-l50")
    assert r.model_mismatch("Qwen/Qwen3.5-2B-Base") is None
    assert r.model_mismatch("/models/qwen3.5-2b-base/") is None
    assert "post-trained sibling" in r.model_mismatch("Qwen/Qwen3.5-2B")
    assert "not Qwen/Qwen3-8B" in r.model_mismatch("Qwen/Qwen3-8B")
    instruct = get_release("qwen-scope-3.5-27b-w80k-l50")
    assert instruct.model_mismatch("Qwen/Qwen3.5-27B") is None
    assert "base sibling" in instruct.model_mismatch("Qwen/Qwen3.5-27B-Base")
    # a name that says nothing about the checkpoint: no claim either way
    assert r.model_mismatch("/tmp/some-local-dir") is None and "not /x/llama-base" in r.model_mismatch("/x/llama-base")
