"""Causal, document-aware, sliding-window attention over packed sequences.

Each batch row is one packed sequence of documents, each starting with a BOS token. Query q may attend key k iff

    k <= q   and   doc[k] == doc[q]   and   q - k < window,      doc = cumsum(tokens == BOS) along the row.

Two implementations of that one rule:
- `block_mask` + FlexAttention (GPU): a BlockMask built from per-block document statistics, never from a T x T
  mask (T is 49,152 in the record run). The window is a tensor read by the mask, so growing it never recompiles.
- `dense_mask` + SDPA (CPU training, tests): the explicit boolean mask, for small T only.
`attend` dispatches on the mask's type, so the transformer block has one signature for both.

Shape legend: B batch rows, T tokens, H heads, d head dim, N = T // block_size blocks (Q query, K key blocks).
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def document_ids(inputs_BT: Tensor, bos_id: int) -> Tensor:
    """Document index of every token: tokens before the first BOS are document 0, each BOS opens a new one."""
    return (inputs_BT == bos_id).cumsum(dim=1, dtype=torch.int32)


def short_window(window: Tensor, block_size: int) -> Tensor:
    """The short-window layers' window: half the long one, rounded down to whole blocks, at least one block."""
    return torch.clamp_min(window // 2 // block_size, 1) * block_size


def dense_mask(doc_BT: Tensor, window: Tensor) -> Tensor:
    """The explicit (B, 1, T, T) boolean mask (True = may attend) for SDPA and for reference checks."""
    pos_T = torch.arange(doc_BT.size(1), device=doc_BT.device)
    dist_TT = pos_T[:, None] - pos_T[None, :]  # q - k
    same_doc_BTT = doc_BT[:, :, None] == doc_BT[:, None, :]
    return (same_doc_BTT & (dist_TT >= 0) & (dist_TT < window))[:, None]


def _ordered(dense_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """Block-sparse layout from a block-level boolean matrix: counts (B, 1, Q) and indices (B, 1, Q, K), listed
    blocks first. The indices keep their full K width whatever the window, so shapes never change."""
    num_BQ = dense_BQK.sum(dim=-1, dtype=torch.int32)
    indices_BQK = torch.argsort(dense_BQK.to(torch.uint8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num_BQ[:, None].contiguous(), indices_BQK[:, None].contiguous()


def block_mask(doc_BT: Tensor, window: Tensor, block_size: int) -> BlockMask:
    """FlexAttention BlockMask for the mask rule above, from per-block document ranges.

    A (query block, key block) pair is
    - full (computed without the mask_mod) when the key block lies strictly before the query block, all tokens of
      both blocks belong to one document and even the farthest pair is inside the window;
    - partial (mask_mod decides per token) when some pair may be allowed: key block not after the query block,
      document ranges touching, nearest pair inside the window;
    - skipped otherwise.
    Needs T to be a multiple of block_size (the caller checks).
    """
    B, T = doc_BT.shape
    assert T % block_size == 0, (T, block_size)
    doc_BNS = doc_BT.view(B, T // block_size, block_size)
    first_BN, last_BN = doc_BNS[..., 0], doc_BNS[..., -1]  # document ids never decrease along a row (cumsum)
    block_N = torch.arange(T // block_size, device=doc_BT.device)
    gap_QK = block_N[:, None] - block_N[None, :]  # query block - key block
    nearest_QK = torch.clamp_min((gap_QK - 1) * block_size + 1, 0)  # smallest q - k over the block pair
    farthest_QK = gap_QK * block_size + block_size - 1  # largest q - k over the block pair

    touching_BQK = last_BN[:, None, :] >= first_BN[:, :, None]  # with k block <= q block: ranges overlap
    single_doc_BN = first_BN == last_BN
    one_doc_BQK = single_doc_BN[:, :, None] & single_doc_BN[:, None, :] & (first_BN[:, :, None] == first_BN[:, None, :])

    any_BQK = (gap_QK >= 0) & touching_BQK & (nearest_QK < window)
    full_BQK = (gap_QK > 0) & one_doc_BQK & (farthest_QK < window)
    partial_BQK = any_BQK & ~full_BQK

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx]) & (q_idx - kv_idx < window)

    kv_num_blocks, kv_indices = _ordered(partial_BQK)
    full_kv_num_blocks, full_kv_indices = _ordered(full_BQK)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod)


@functools.cache
def _compiled_flex_attention():
    # Eager flex_attention materialises the full score matrix; compiling it generates the fused kernel.
    return torch.compile(flex_attention, dynamic=False)


def attend(q_BHTd: Tensor, k_BHTd: Tensor, v_BHTd: Tensor, mask: BlockMask | Tensor, scale: float) -> Tensor:
    """Attention under `mask`: FlexAttention for a BlockMask, SDPA for a dense boolean mask. Returns (B, H, T, d)."""
    if isinstance(mask, BlockMask):
        if q_BHTd.is_cuda and not torch.compiler.is_compiling():
            flex = _compiled_flex_attention()
        else:  # CPU (forward only, unfused), or inside a compiled region, which fuses flex_attention itself
            flex = flex_attention
        return flex(q_BHTd, k_BHTd, v_BHTd, block_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, attn_mask=mask, scale=scale)
