"""model/gpt.py's key offset (modded-nanogpt's partial key offset): offset_keys against a loop, the dims it moves
against the rotary tables, and the model's long-window layers attending over offset keys. The decoding cache and
FastGPT are tested with it in tests/test_decode.py and tests/test_fast.py, its receptive field in
tests/test_model.py."""
import pytest
import torch

from model import gpt as gpt_module
from model.gpt import Attention, apply_rotary, offset_keys, rotary_tables
from test_model import KEY_OFFSET, TINY, batch, tiny_model


def offset_by_loop(k_BTHd: torch.Tensor, before_B1Hd: torch.Tensor | None) -> torch.Tensor:
    """offset_keys position by position and pair by pair: the pairs (j, j + d/2) for j from d/4 on do not turn."""
    out = k_BTHd.clone()
    d = k_BTHd.size(-1)
    first = k_BTHd[:, 0] if before_B1Hd is None else before_B1Hd[:, 0]
    for t in range(k_BTHd.size(1)):
        source = k_BTHd[:, t - 1] if t else first
        for j in range(d // 4, d // 2):
            for dim in (j, j + d // 2):
                out[:, t, :, dim] = source[:, :, dim]
    return out


@pytest.mark.parametrize("head_dim", [4, 16])
def test_offset_keys_equals_a_loop_over_positions_and_pairs(head_dim):
    """offset_keys against offset_by_loop, with and without the key before position 0, values and gradients; the
    input is left as it was, position 0 keeps its own key without one before it, the turning dims stay."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 5, 3, head_dim, generator=g)
    before, upstream = torch.randn(2, 1, 3, head_dim, generator=g), torch.randn(2, 5, 3, head_dim, generator=g)
    kept = k.clone()
    for before_B1Hd in (None, before):
        got, want = (f(k.requires_grad_(), before_B1Hd) for f in (offset_keys, offset_by_loop))
        assert torch.equal(got, want)
        torch.testing.assert_close(*(torch.autograd.grad(out, k, upstream)[0] for out in (got, want)), rtol=0,
                                   atol=0)
    k = k.detach()
    assert torch.equal(k, kept)
    got = offset_keys(k)
    turning = [j for j in range(head_dim) if j % (head_dim // 2) < head_dim // 4]
    assert torch.equal(got[:, 0], k[:, 0]) and torch.equal(got[..., turning], k[..., turning])
    assert not torch.equal(offset_keys(k, before)[:, 0], k[:, 0]) and not torch.equal(got, k)


@pytest.mark.parametrize("head_dim", [4, 8, 32, 128])
def test_offset_keys_moves_exactly_the_dims_that_rotary_keeps_still(head_dim):
    """The dims offset_keys takes from the position before are those that apply_rotary leaves alone at every
    position, the pairs whose angle in rotary_tables is 0 throughout: half of them."""
    T = 16
    cos, sin = rotary_tables(T, head_dim, 1024.0, torch.device("cpu"))
    still_P = ((cos == 1) & (sin == 0)).all(dim=0)
    x = torch.randn(1, 1, 1, head_dim, generator=torch.Generator().manual_seed(0)).expand(1, T, 1, head_dim)
    still_d = (apply_rotary(x, cos, sin) == x).all(dim=1).flatten()
    assert torch.equal(still_d, torch.cat([still_P, still_P])) and still_d.sum() == head_dim // 2
    k = torch.arange(T * head_dim, dtype=torch.float32).view(1, T, 1, head_dim)  # no two entries alike
    moved_d = (offset_keys(k) != k)[0, 1:, 0].all(dim=0)
    assert torch.equal(moved_d, still_d)


def test_key_offset_offsets_the_long_layers_keys_only(monkeypatch):
    """With key_offset the long-window layers (0 and 3) attend over offset keys, the short ones over their own; the
    model stays causal, its logits differ from the same weights' without the offset, and every parameter gets a
    finite, non-zero gradient."""
    prepared, attended = [], []
    real_prepare, real_attend = gpt_module.prepare_qkv, Attention.attend_and_project

    def prepare_qkv(*args):
        q, k, v = real_prepare(*args)
        prepared.append(k.detach())
        return q, k, v

    def attend_and_project(self, q, k, *args):
        attended.append(k.detach())
        return real_attend(self, q, k, *args)

    monkeypatch.setattr(gpt_module, "prepare_qkv", prepare_qkv)
    monkeypatch.setattr(Attention, "attend_and_project", attend_and_project)
    model = tiny_model(KEY_OFFSET, random=True)
    assert [block.attn.offsets_keys for block in model.blocks] == [True, False, False, True]
    inputs, targets = batch()
    window = torch.tensor(64)
    loss = model(inputs, targets, window)
    still = [j for j in range(TINY.head_dim) if j % (TINY.head_dim // 2) >= TINY.head_dim // 4]
    for layer, (own, got) in enumerate(zip(prepared, attended, strict=True)):
        want = own.clone()
        if layer in (0, 3):
            want[:, 1:, :, still] = own[:, :-1, :, still]
            assert not torch.equal(got, own)
        assert torch.equal(got, want), layer
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, name
    plain = tiny_model(random=True)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
        future = inputs.clone()
        future[1, 100] = 7 if inputs[1, 100] != 7 else 8
        base, changed = model.logits(inputs, window), model.logits(future, window)
        assert (plain.logits(inputs, window) - base).abs().max() > 1  # 3.2
    assert torch.equal(changed[1, :100], base[1, :100]) and not torch.allclose(changed[1, 100:], base[1, 100:])
