"""model/attention.py against references: the BlockMask equals the explicit mask token for token (so FlexAttention's
skipped and mask-free blocks are right), flex == SDPA == a written-out softmax attention, and SDPA's gradients equal
the reference's."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from model.attention import attend, block_mask, dense_mask, document_ids
from model.config import short_window

BOS = 0
BLOCK = 32
T = 256


def layouts(seq_len: int = T, block: int = BLOCK) -> torch.Tensor:
    """Token rows (4, seq_len) covering the cases that matter: random short documents, documents longer than
    the windows, one document spanning the whole row, and tokens before the first BOS."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(1, 50, (4, seq_len), generator=g)
    rows[0, torch.randint(0, seq_len, (seq_len // 20,), generator=g)] = BOS  # many short documents at random
    rows[1, [0, 7, seq_len * 5 // 8]] = BOS  # a document over more than half the row
    rows[2, 0] = BOS  # one document over the whole row
    # tokens before the first BOS, a one-token document, a block-aligned BOS, an unaligned one, and one on a block's
    # last token (that block's last document is not its first-but-one token's)
    rows[3, [40, 41, 2 * block, 3 * block - 1, seq_len * 3 // 4 + 8]] = BOS
    return rows


def materialise(mask) -> torch.Tensor:
    """Token-level (B, 1, T, T) view of a BlockMask the way the fused kernel reads it: listed partial blocks go
    through mask_mod, full blocks are all True, unlisted blocks all False."""
    B, _, Q = mask.kv_num_blocks.shape
    qs, ks = mask.BLOCK_SIZE
    out = torch.zeros(B, 1, Q * qs, mask.kv_indices.shape[-1] * ks, dtype=torch.bool)
    for b in range(B):
        for q in range(Q):
            rows = slice(q * qs, (q + 1) * qs)
            for k in mask.full_kv_indices[b, 0, q, : mask.full_kv_num_blocks[b, 0, q]].tolist():
                out[b, 0, rows, k * ks:(k + 1) * ks] = True
            for k in mask.kv_indices[b, 0, q, : mask.kv_num_blocks[b, 0, q]].tolist():
                q_idx = torch.arange(q * qs, (q + 1) * qs)[:, None]
                kv_idx = torch.arange(k * ks, (k + 1) * ks)[None, :]
                out[b, 0, rows, k * ks:(k + 1) * ks] = mask.mask_mod(torch.tensor(b), torch.tensor(0), q_idx, kv_idx)
    return out


def reference_mask(tokens: torch.Tensor, window: int, block: int = BLOCK) -> torch.Tensor:
    """The mask rule written out with loops over documents: no shared code with model/attention.py. A query sees
    its document's tokens up to itself, from the first token of the block ceil(window / block) - 1 blocks back."""
    B, T_ = tokens.shape
    blocks = -(-window // block)
    out = torch.zeros(B, 1, T_, T_, dtype=torch.bool)
    for b in range(B):
        starts = [0] + [t for t in range(T_) if tokens[b, t] == BOS and t > 0] + [T_]
        for lo, hi in zip(starts[:-1], starts[1:]):
            for q in range(lo, hi):
                out[b, 0, q, max(lo, (q // block - blocks + 1) * block):q + 1] = True
    return out


def reference_attention(q, k, v, mask, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# one block; not whole blocks (rounded up to 3 blocks, from either side); aligned; wider than the row
WINDOWS = [BLOCK, 2 * BLOCK + 2, 3 * BLOCK - 1, 4 * BLOCK, 10 * T]


@pytest.mark.parametrize("window", WINDOWS)
def test_dense_mask_matches_written_out_rule(window):
    tokens = layouts()
    got = dense_mask(document_ids(tokens, BOS), torch.tensor(window), BLOCK)
    assert torch.equal(got, reference_mask(tokens, window))


@pytest.mark.parametrize("window", WINDOWS)
def test_block_mask_equals_dense_mask(window):
    tokens = layouts()
    doc = document_ids(tokens, BOS)
    w = torch.tensor(window)
    mask = block_mask(doc, w, BLOCK)
    dense = dense_mask(doc, w, BLOCK)
    assert mask.kv_indices.shape == (4, 1, T // BLOCK, T // BLOCK)  # fixed shape whatever the window
    assert torch.equal(materialise(mask), dense)
    # Full blocks must be exactly the off-diagonal tiles that are entirely allowed: none missed (speed), none
    # wrong (the kernel skips mask_mod there, which the equality above already covers).
    by_tile = dense[:, 0].unflatten(1, (T // BLOCK, BLOCK)).unflatten(3, (T // BLOCK, BLOCK))
    tiles = by_tile.all(dim=(2, 4)) & ~torch.eye(T // BLOCK, dtype=torch.bool)
    full, partial = torch.zeros_like(tiles), torch.zeros_like(tiles)
    for b in range(4):
        for q in range(T // BLOCK):
            full[b, q, mask.full_kv_indices[b, 0, q, : mask.full_kv_num_blocks[b, 0, q]].long()] = True
            partial[b, q, mask.kv_indices[b, 0, q, : mask.kv_num_blocks[b, 0, q]].long()] = True
    assert torch.equal(full, tiles)
    # Partial blocks run mask_mod on every pair (speed): none may be listed where no token may attend
    assert not (partial & ~by_tile.any(dim=(2, 4))).any()
    if window >= 2 * BLOCK:
        assert full[2].any()  # the one-document row has mask-free blocks once the window spans two blocks
    # the window's edge never cuts a block: in the one-document row only the diagonal goes through mask_mod
    assert torch.equal(mask.kv_num_blocks[2], torch.ones_like(mask.kv_num_blocks[2]))


def test_dense_mask_with_a_short_last_block():
    tokens = layouts(T - 6)  # SDPA's path takes any length: the last block has BLOCK - 6 tokens
    for window in (BLOCK, 2 * BLOCK + 2):
        got = dense_mask(document_ids(tokens, BOS), torch.tensor(window), BLOCK)
        assert torch.equal(got, reference_mask(tokens, window))


def test_short_window():
    """The same rule on the model's tensors and on the config's ints (model/config.py, read before torch loads)."""
    windows, expected = (128, 300, 1024, 1792, 49152), [128, 128, 512, 896, 24576]
    assert [int(short_window(torch.tensor(w), 128)) for w in windows] == expected
    assert [short_window(w, 128) for w in windows] == expected
    assert all(type(short_window(w, 128)) is int for w in windows)


def qkv(dtype, seq_len=T, requires_grad=False):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 2, seq_len, 32, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("window", WINDOWS)
def test_flex_equals_sdpa_equals_reference(window):
    tokens = layouts()
    doc, w = document_ids(tokens, BOS), torch.tensor(window)
    q, k, v = qkv(torch.float32)
    expected = reference_attention(q.double(), k.double(), v.double(), reference_mask(tokens, window), 0.12)
    sdpa = attend(q, k, v, dense_mask(doc, w, BLOCK), 0.12)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        flex = attend(q, k, v, block_mask(doc, w, BLOCK), 0.12)
    # fp32 against an fp64 reference: errors of a few ulps of the O(1) outputs
    assert (sdpa.double() - expected).abs().max() < 2e-6
    assert (flex.double() - expected).abs().max() < 2e-6


@pytest.mark.parametrize("window", [3 * BLOCK - 1, 10 * T])
def test_sdpa_gradients_equal_reference(window):
    tokens = layouts()
    mask = dense_mask(document_ids(tokens, BOS), torch.tensor(window), BLOCK)
    q, k, v = qkv(torch.float64, requires_grad=True)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(attend(q, k, v, mask, 0.12), (q, k, v), grad_out)
    expected = torch.autograd.grad(reference_attention(q, k, v, reference_mask(tokens, window), 0.12), (q, k, v),
                                   grad_out)
    for a, b in zip(got, expected):
        assert (a - b).abs().max() < 1e-10  # fp64 throughout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_matches_sdpa_on_gpu():
    """The fused kernel (which skips mask_mod on full blocks) against SDPA, forward and backward, in bf16."""
    seq_len, block = 1024, 128  # the fused kernel's tiles need blocks of 128
    tokens = layouts(seq_len, block).cuda()
    doc, w = document_ids(tokens, BOS), torch.tensor(300, device="cuda")
    q, k, v = [t.cuda().bfloat16().requires_grad_() for t in qkv(torch.float32, seq_len)]
    q2, k2, v2 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flex = attend(q, k, v, block_mask(doc, w, block), 0.12)
    sdpa = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=dense_mask(doc, w, block), scale=0.12)
    assert (flex.float() - sdpa.float()).abs().max() < 2e-2  # bf16 outputs: a few bf16 ulps
    grad_out = torch.randn_like(flex)
    for a, b in zip(torch.autograd.grad(flex, (q, k, v), grad_out), torch.autograd.grad(sdpa, (q2, k2, v2), grad_out)):
        assert (a.float() - b.float()).abs().max() < 5e-2
