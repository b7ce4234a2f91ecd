"""Causal, document-aware, sliding-window attention over packed sequences.

Each batch row is one packed sequence of documents, each starting with a BOS token. Query q may attend key k iff

    k <= q   and   doc[k] == doc[q]   and   q // S - k // S < ceil(window / S),   doc = cumsum(tokens == BOS),

S the block size (128): the window is counted in whole blocks of the row, the query's own block and the ones
before it, as in record #28 (modded-nanogpt). A query at the end of its block sees window - 1 tokens back, one at
its start window - S. Cut at the exact token distance instead, every pair of blocks at the window's edge is
partial (mask_mod evaluated per token), and a partial pair costs FlexAttention's backward about three times a
full one: on the H200 forward + backward took 1.950 against 2.222 ms a call at window 896 and 1.642 against 1.778
at 384, and the training step 17.2 ms less (bench/results/flex_rule_1xH200.json, bench/results/README.md).

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

from model.config import window_blocks


def document_ids(inputs_BT: Tensor, bos_id: int) -> Tensor:
    """Document index of every token: tokens before the first BOS are document 0, each BOS opens a new one."""
    return (inputs_BT == bos_id).cumsum(dim=1, dtype=torch.int32)


def dense_mask(doc_BT: Tensor, window: Tensor, block_size: int) -> Tensor:
    """The explicit (B, 1, T, T) boolean mask (True = may attend) for SDPA and for reference checks; T need not be a
    multiple of block_size (the last block is short)."""
    pos_T = torch.arange(doc_BT.size(1), device=doc_BT.device)
    block_T = pos_T // block_size
    gap_TT = block_T[:, None] - block_T[None, :]  # query block - key block
    same_doc_BTT = doc_BT[:, :, None] == doc_BT[:, None, :]
    causal_TT = pos_T[:, None] >= pos_T[None, :]
    return (same_doc_BTT & causal_TT & (gap_TT < window_blocks(window, block_size)))[:, None]


def _ordered(dense_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """Block-sparse layout from a block-level boolean matrix: counts (B, 1, Q) and indices (B, 1, Q, K), listed
    blocks first. The indices keep their full K width whatever the window, so shapes never change."""
    num_BQ = dense_BQK.sum(dim=-1, dtype=torch.int32)
    indices_BQK = torch.argsort(dense_BQK.to(torch.uint8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num_BQ[:, None].contiguous(), indices_BQK[:, None].contiguous()


def block_pairs(doc_BT: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per (query block, key block) pair, from the blocks' document ranges: the gap (query block - key block) (Q, K),
    whether their documents may meet, and whether both blocks lie in one document (B, Q, K). Needs T to be a
    multiple of block_size (the caller checks)."""
    B, T = doc_BT.shape
    assert T % block_size == 0, (T, block_size)
    doc_BNS = doc_BT.view(B, T // block_size, block_size)
    first_BN, last_BN = doc_BNS[..., 0], doc_BNS[..., -1]  # document ids never decrease along a row (cumsum)
    block_N = torch.arange(T // block_size, device=doc_BT.device)
    gap_QK = block_N[:, None] - block_N[None, :]
    touching_BQK = last_BN[:, None, :] >= first_BN[:, :, None]  # with k block <= q block: ranges overlap
    single_doc_BN = first_BN == last_BN
    one_doc_BQK = single_doc_BN[:, :, None] & single_doc_BN[:, None, :] & (first_BN[:, :, None] == first_BN[:, None, :])
    return gap_QK, touching_BQK, one_doc_BQK


def block_mask(doc_BT: Tensor, window: Tensor, block_size: int) -> BlockMask:
    """FlexAttention BlockMask for the mask rule above, from per-block document ranges.

    A (query block, key block) pair inside the window (0 <= gap < window_blocks) is
    - full (computed without the mask_mod) when the key block lies strictly before the query block and all tokens
      of both blocks belong to one document;
    - partial (mask_mod decides per token) when the document ranges touch: the diagonal, and blocks where a
      document starts;
    - skipped otherwise, as is every pair outside the window.
    Needs T to be a multiple of block_size (the caller checks).
    """
    gap_QK, touching_BQK, one_doc_BQK = block_pairs(doc_BT, block_size)
    blocks = window_blocks(window, block_size)
    inside_QK = (gap_QK >= 0) & (gap_QK < blocks)
    full_BQK = inside_QK & (gap_QK > 0) & one_doc_BQK
    partial_BQK = inside_QK & touching_BQK & ~full_BQK

    def mask_mod(b, h, q_idx, kv_idx):
        # the window's test is true on every listed block; it is here for the unfused path (eager, CPU), which
        # applies mask_mod everywhere and the block lists nowhere
        return ((kv_idx <= q_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx])
                & (q_idx // block_size - kv_idx // block_size < blocks))

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
