"""hopper_topk's candidate merge: the TileLang merge kernel's algorithm (its torch twin, on CPU) is the top-k of the
keys with equal keys taken in slot order, and equals the torch ``merge_candidates`` up to the order of equal keys, on
random and adversarial candidates (ties across tiles, zero keys, everything in one tile, everything selected, c = 1,
one tile); the kernel lowers and compiles for sm_90a without a GPU; ``fused_encode`` merges kernel candidates with it;
on Hopper the kernel equals its twin bit for bit."""
from __future__ import annotations

import pytest
import torch

from saes import fused as fe
from saes import hopper_topk as hk
from tests.saes.test_fused import _crowded, _sae

BN = hk.BLOCK_N
CASES = ("random", "ties", "few-positive", "one-tile", "all-zero")
# (NT, c, k): the 2048 -> 32768 k=100 shape, an odd one, everything selected, c = 1, one tile.
SIZES = [(128, 8, 100), (7, 5, 33), (4, 8, 32), (16, 1, 10), (1, 8, 5)]


def synthetic_candidates(case: str, n: int, n_tiles: int, c: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """``cand [n, NT, c]`` int32 as the candidate kernel writes them, from made-up pre-activations ``[n, NT, 256]``:

    - ``random``: Gaussian (half of them zero after the ReLU);
    - ``ties``: a handful of levels, so equal keys (same column, same value) recur across tiles;
    - ``few-positive``: a few positives a row, then zero keys (``255 - column``), equal across tiles;
    - ``one-tile``: tile 0 holds every large value (its c-th candidate beats the k-th pick: flagged rows);
    - ``all-zero``: nothing positive, every key a zero key.
    """
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(n, n_tiles, BN, generator=g)
    if case == "ties":
        pre = torch.randint(-1, 3, (n, n_tiles, BN), generator=g).float() * 0.75
    elif case == "few-positive":
        pre = torch.where(torch.rand(n, n_tiles, BN, generator=g) < 3.0 / (n_tiles * BN), pre.abs() + 0.1, -1.0)
    elif case == "one-tile":
        pre[:, 0] = pre[:, 0].abs() + 10.0
    elif case == "all-zero":
        pre = -pre.abs()
    j = torch.arange(BN, dtype=torch.int32)
    keys = (pre.view(torch.int32).clamp_min(0) & -(1 << hk._LOW_BITS)) | (BN - 1 - j)
    return keys.topk(c, dim=-1, sorted=True).values.contiguous().to(device)


def stable_merge(cand: torch.Tensor, k: int):
    """The top-k keys of each row by a stable descending sort (equal keys in slot order), decoded like the merge."""
    n, n_tiles, c = cand.shape
    top, slot = cand.reshape(n, -1).sort(dim=1, descending=True, stable=True)
    top, slot = top[:, :k], slot[:, :k]
    values = (top & -(1 << hk._LOW_BITS)).view(torch.float32)
    indices = torch.div(slot, c, rounding_mode="floor") * BN + (BN - 1 - (top & (BN - 1))).long()
    last = cand[:, :, c - 1]
    return values, indices, ((last >= 1 << hk._LOW_BITS) & (last > top[:, k - 1 : k])).any(dim=1)


def assert_same_merge_up_to_ties(got, want, cand: torch.Tensor):
    """Same values (bit for bit) and flags; every (value, index) is a candidate of its tile; indices distinct; the
    same keys as ``want`` (so only equal keys may swap their tiles)."""
    values, indices, flagged = got
    assert values.dtype == torch.float32 and indices.dtype == torch.long and flagged.dtype == torch.bool
    assert torch.equal(values, want[0]) and torch.equal(flagged, want[2])
    assert (indices.sort(dim=1).values.diff(dim=1) > 0).all(), "an index repeats within a row"
    keys = values.view(torch.int32) | (BN - 1 - indices % BN).int()
    want_keys = want[0].view(torch.int32) | (BN - 1 - want[1] % BN).int()
    assert torch.equal(keys.sort(dim=1).values, want_keys.sort(dim=1).values)
    tile = torch.div(indices, BN, rounding_mode="floor")
    own = cand.gather(1, tile[..., None].expand(-1, -1, cand.shape[2]))
    assert (own == keys[..., None]).any(dim=-1).all(), "a (value, index) pair is not a candidate of its tile"


def _assert_equal(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------- the twin
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n_tiles,c,k", SIZES)
def test_twin_is_the_stable_topk_and_merge_candidates_up_to_ties(case, n_tiles, c, k):
    cand = synthetic_candidates(case, 48, n_tiles, c, seed=n_tiles + c)
    twin = hk.merge_candidates_twin(cand, k)
    want = stable_merge(cand, k)
    _assert_equal(twin, want)
    assert_same_merge_up_to_ties(hk.merge_candidates(cand, k), want, cand)


def test_adversarial_cases_hold_what_they_promise():
    """The generators make the situations the twin must get right: ties at the k-th key, zero keys, flagged rows."""
    for case in CASES:
        cand = synthetic_candidates(case, 48, 128, 8)
        values, _, flagged = hk.merge_candidates_twin(cand, 100)
        keys = cand.reshape(48, -1)
        kth = keys.topk(100, dim=1).values[:, -1:]
        if case in ("ties", "few-positive", "all-zero"):
            # more keys equal the k-th one than places left for them: the tie break decides
            assert (((keys == kth).sum(1) > 1) & ((keys >= kth).sum(1) > 100)).any(), case
        if case in ("few-positive", "all-zero"):
            assert (values == 0).any(dim=1).all() and not flagged.any(), case
        if case == "one-tile":
            assert flagged.all()


def test_twin_on_the_kernel_twins_candidates_of_an_sae():
    sae, x = _crowded()
    for c in (2, 4, 8):
        cand = hk.topk_candidates_reference(x, sae.W_enc, sae.b_enc, c)
        _assert_equal(hk.merge_candidates_twin(cand, sae.k), stable_merge(cand, sae.k))
        assert_same_merge_up_to_ties(hk.merge_candidates(cand, sae.k), stable_merge(cand, sae.k), cand)


def test_twin_takes_equal_keys_in_tile_order_when_all_tiles_are_equal():
    """Every key of every tile equal across tiles (identical tiles): the first tiles win, in slot order."""
    one = synthetic_candidates("random", 5, 1, 6)
    cand = one.expand(5, 9, 6).contiguous()
    values, indices, _ = hk.merge_candidates_twin(cand, 20)
    tiles = torch.div(indices, BN, rounding_mode="floor")
    # 6 keys a tile, each repeated 9 times: ranks 0..8 are the first key of tiles 0..8, and so on
    assert torch.equal(tiles[:, :9], torch.arange(9).expand(5, 9))
    assert torch.equal(values[:, :9], values[:, :1].expand(5, 9))
    _assert_equal((values, indices), stable_merge(cand, 20)[:2])


# --------------------------------------------------------------------------------------------- wiring and checks
def test_merge_kernel_refuses_rows_wider_than_its_registers():
    cand = torch.zeros(2, 256, 24, dtype=torch.int32)  # 6144 slots: the 4c re-run at d_sae = 65536, k = 100
    with pytest.raises(ValueError, match=r"NT \* c <= 4096, got k=100, NT=256, c=24; use merge_candidates"):
        hk.merge_candidates_kernel(cand, 100)
    with pytest.raises(ValueError, match="k=40"):
        hk.merge_candidates_kernel(torch.zeros(2, 4, 8, dtype=torch.int32), 40)


def test_kernel_candidates_go_through_the_merge_kernel_and_wide_reruns_through_torch(monkeypatch):
    """The default operands (real kernel) merge with ``merge_candidates_kernel`` (here its twin) where a row fits,
    with the torch merge where it does not; the codes are those of the torch merge."""
    sae, x = _crowded()
    want = fe._encode_tilelang(x, sae, c=4, candidates=hk.topk_candidates_reference)
    calls = []

    def spy(name, fn):
        return lambda cand, k: calls.append((name, cand.shape[1] * cand.shape[2])) or fn(cand, k)

    monkeypatch.setattr(hk, "topk_candidates", hk.topk_candidates_reference)
    monkeypatch.setattr(hk, "merge_candidates_kernel", spy("kernel", hk.merge_candidates_twin))
    monkeypatch.setattr(hk, "merge_candidates", spy("torch", hk.merge_candidates))
    # 16 tiles: 64 slots at c = 4, 256 for the 4c re-run; a 100-slot limit sends the re-run to torch
    monkeypatch.setattr(hk, "MERGE_MAX_SLOTS", 100)
    got = fe._encode_tilelang(x, sae, c=4)
    assert calls == [("kernel", 64), ("torch", 256)]
    assert_same_merge_up_to_ties((got.values, got.indices, torch.zeros(len(x), dtype=torch.bool)),
                                 (want.values, want.indices, torch.zeros(len(x), dtype=torch.bool)),
                                 hk.topk_candidates_reference(x, sae.W_enc, sae.b_enc, 16))


# --------------------------------------------------------------------------------------------------- the kernel
@pytest.mark.slow
@pytest.mark.parametrize("n_slots,c,k", [(1024, 8, 100), (35, 5, 33)], ids=["32k-k100", "odd"])
def test_merge_kernel_lowers_and_compiles_for_sm90a_without_a_gpu(n_slots, c, k):
    pytest.importorskip("tilelang")
    src = hk.compile_merge_candidates(n_slots, c, k).get_kernel_source()
    assert "__ballot_sync" in src and "__popc" in src  # the compaction: a ballot and a prefix popcount per slot row
    assert "tl::warp_reduce_sum" in src and "Values[" in src and "Indices[" in src and "Flagged[" in src
    # one warp a row, its keys in registers: no block-wide reduction buffers
    assert f"int keys[{-(-n_slots // 32)}]" in src


@pytest.mark.hopper
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n_tiles,c,k", SIZES + [(256, 6, 100), (256, 5, 50), (128, 32, 100)])
def test_merge_kernel_equals_its_twin_bit_for_bit_on_hopper(case, n_tiles, c, k):
    n = 1001  # not a multiple of the 8 rows of a CTA
    cand = synthetic_candidates(case, n, n_tiles, c, seed=n_tiles * c, device="cuda")
    kernel = hk.compile_merge_candidates(n_tiles * c, c, k)
    # poisoned outputs: every slot must be written
    values = torch.full((n, k), float("nan"), device="cuda")
    indices = torch.full((n, k), -1, device="cuda", dtype=torch.long)
    flagged = torch.full((n,), 7, device="cuda", dtype=torch.uint8)
    kernel(cand.reshape(n, -1), values, indices, flagged)
    assert not values.isnan().any() and (indices >= 0).all() and (flagged <= 1).all()
    got = hk.merge_candidates_kernel(cand, k)
    _assert_equal(got, (values, indices, flagged.bool()))
    _assert_equal(got, hk.merge_candidates_twin(cand, k))
    assert_same_merge_up_to_ties(got, hk.merge_candidates(cand, k), cand)


@pytest.mark.hopper
@pytest.mark.parametrize("n,d_model,d_sae,k", [(4133, 2048, 32768, 100), (77, 256, 2048, 16), (1, 256, 2048, 16)])
def test_merge_kernel_on_the_candidate_kernels_output_on_hopper(n, d_model, d_sae, k):
    sae = _sae(d_model, d_sae, k, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(n, d_model, device="cuda").bfloat16()
    c = hk.candidates_per_tile(k, d_sae)
    cand = hk.topk_candidates(x, sae.W_enc.detach(), sae.b_enc.detach().float(), c)
    got = hk.merge_candidates_kernel(cand, k)
    _assert_equal(got, hk.merge_candidates_twin(cand, k))
    assert_same_merge_up_to_ties(got, hk.merge_candidates(cand, k), cand)
    # and fused_encode on top of it agrees with the multi-pass path fed by the torch merge
    ref = fe._encode_tilelang(x, sae, candidates=hk.topk_candidates)
    codes = fe.fused_encode(x, sae, backend="tilelang")
    assert torch.equal(codes.values, ref.values)
    assert (codes.indices == ref.indices).float().mean() > 0.999  # equal keys may swap tiles
