"""``hopper/layout.py``: which q, k, v count as transformers' channels-first layout (the views its Gated DeltaNet
layer passes the op), and the buffer recovered from them."""
import pytest
import torch

pytest.importorskip("tilelang")
from flashqla_kernels.gated_delta_rule.hopper import layout  # noqa: E402


def _transformers_views(B=2, Tn=70, Hk=2, Hv=4, K=64, V=64, dtype=torch.bfloat16):
    """q, k, v as transformers makes them: split of the transposed [B, C, T] convolution output, heads unflattened."""
    buffer = torch.randn(B, 2 * Hk * K + Hv * V, Tn).to(dtype)
    q, k, v = torch.split(buffer.transpose(1, 2), [Hk * K, Hk * K, Hv * V], dim=-1)
    return buffer, q.reshape(B, Tn, Hk, K), k.reshape(B, Tn, Hk, K), v.reshape(B, Tn, Hv, V)


@pytest.mark.parametrize("B,Hk,Hv", [(2, 2, 4), (1, 16, 16), (1, 1, 2), (3, 1, 1)])
def test_finds_the_buffer_behind_transformers_views(B, Hk, Hv):
    """Also for one sequence or one head, whose size-1 dims torch gives other strides (a one-sequence view has T, not
    C T, as its batch stride)."""
    buffer, q, k, v = _transformers_views(B=B, Hk=Hk, Hv=Hv)
    C = buffer.shape[1]
    assert [s for s, n in zip(q.stride(), q.shape) if n > 1] == [s for s, n in zip((C * 70, 1, 64 * 70, 70), q.shape)
                                                                 if n > 1]
    found = layout.channels_first_buffer(q, k, v)
    assert found is not None and found.is_contiguous() and found.data_ptr() == buffer.data_ptr()
    assert torch.equal(found, buffer)


def test_finds_it_at_an_offset_into_a_larger_storage():
    """The buffer need not start its storage (a slice of a bigger allocation): the view starts where q does."""
    big = torch.randn(3 * 384 * 70).to(torch.bfloat16)
    buffer = big[384 * 70:].view(2, 384, 70)
    q, k, v = torch.split(buffer.transpose(1, 2), [128, 128, 128], dim=-1)
    q, k, v = q.reshape(2, 70, 2, 64), k.reshape(2, 70, 2, 64), v.reshape(2, 70, 2, 64)
    found = layout.channels_first_buffer(q, k, v)
    assert found is not None and found.data_ptr() == buffer.data_ptr() and torch.equal(found, buffer)


def test_other_layouts_are_left_to_the_strided_copies():
    buffer, q, k, v = _transformers_views()
    # token-major tensors (the benchmarks', FLA's tests'), k and q swapped, separate storages
    assert layout.channels_first_buffer(q.contiguous(), k.contiguous(), v.contiguous()) is None
    assert layout.channels_first_buffer(k, q, v) is None
    assert layout.channels_first_buffer(q, k.clone(), v) is None
    # a v that is not the third slice of the same buffer
    other = _transformers_views()[3]
    assert layout.channels_first_buffer(q, k, other) is None
    # one token: the strides do not tell the layout apart (and the copies cost nothing)
    _, q1, k1, v1 = _transformers_views(Tn=1)
    assert layout.channels_first_buffer(q1, k1, v1) is None
    # channel slices the kernel's 64-channel tiles would straddle
    _, q2, k2, v2 = _transformers_views(Hk=1, Hv=1, K=32, V=32)
    assert layout.channels_first_buffer(q2, k2, v2) is None


def _repeated_views(B=2, Tn=70, Hk=2, Hv=4, K=64, V=64, dtype=torch.bfloat16):
    """transformers < 5.23 with Hv > Hk: q and k repeated to the value heads (new tensors), v still a view."""
    buffer, q, k, v = _transformers_views(B=B, Tn=Tn, Hk=Hk, Hv=Hv, K=K, V=V, dtype=dtype)
    rep = Hv // Hk
    return buffer, q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v


@pytest.mark.parametrize("B,Hk,Hv", [(2, 2, 4), (1, 16, 32), (3, 1, 2), (2, 4, 4)])
def test_finds_v_alone_as_a_slice_of_the_buffer(B, Hk, Hv):
    """The slice's channels in the recovered buffer are exactly v's, and the view stays inside v's storage (it ends
    where the buffer does: v is its last slice)."""
    buffer, q, k, v = _repeated_views(B=B, Hk=Hk, Hv=Hv)
    assert layout.channels_first_buffer(q, k, v) is None
    found = layout.channels_first_slice(v)
    assert found is not None
    view, c_first = found
    F = Hv * 64
    assert view.shape == (B, (buffer.shape[1] if B > 1 else F), 70) and view.is_contiguous()
    assert c_first == (buffer.shape[1] - F if B > 1 else 0)
    assert torch.equal(view[:, c_first:c_first + F].transpose(1, 2).reshape(B, 70, Hv, 64), v)
    if B > 1:
        assert view.data_ptr() == buffer.data_ptr() and torch.equal(view, buffer)


def test_v_alone_in_other_layouts_is_left_to_the_strided_copy():
    _, _, _, v = _repeated_views()
    assert layout.channels_first_slice(v.contiguous()) is None
    # one token, and a slice the kernel's 64-channel tiles would straddle
    assert layout.channels_first_slice(_repeated_views(Tn=1)[3]) is None
    assert layout.channels_first_slice(_repeated_views(Hk=1, Hv=1, K=32, V=32)[3]) is None
    # a token-strided view that is not channels-first (every other token of a token-major tensor)
    assert layout.channels_first_slice(torch.randn(2, 140, 4, 64).to(torch.bfloat16)[:, ::2]) is None
