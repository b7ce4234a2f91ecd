"""Causal, document-aware, sliding-window attention over packed sequences. Query q may attend key k iff

    k <= q   and   doc[k] == doc[q]   and   q // S - k // S < ceil(window / S),   doc = cumsum(tokens == BOS),

S the block size: the window counts whole blocks (record #28), so that no block pair at its edge is partial, which
would cost FlexAttention's backward more. `block_mask` + FlexAttention (GPU) builds a BlockMask from per-block
document statistics, with the window a tensor so that growing it never recompiles; `dense_mask` + SDPA (CPU, tests)
is the explicit mask, for small T. `attend` dispatches on the mask's type.

Shape legend: B batch rows, T tokens, H heads, d head dim, N = T // block_size blocks (Q query, K key blocks).
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from model.config import window_blocks


def document_ids(inputs_BT: Tensor, bos_id: int) -> Tensor:
    """Document index of every token; each BOS opens a new document."""
    return (inputs_BT == bos_id).cumsum(dim=1, dtype=torch.int32)


def dense_mask(doc_BT: Tensor, window: Tensor, block_size: int) -> Tensor:
    """The explicit (B, 1, T, T) boolean mask (True = may attend) for SDPA; the last block may be short."""
    pos_T = torch.arange(doc_BT.size(1), device=doc_BT.device)
    block_T = pos_T // block_size
    gap_TT = block_T[:, None] - block_T[None, :]  # query block - key block
    same_doc_BTT = doc_BT[:, :, None] == doc_BT[:, None, :]
    causal_TT = pos_T[:, None] >= pos_T[None, :]
    return (same_doc_BTT & causal_TT & (gap_TT < window_blocks(window, block_size)))[:, None]


def _ordered(dense_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """Counts (B, 1, Q) and indices (B, 1, Q, K), listed blocks first, of a block-level boolean matrix."""
    num_BQ = dense_BQK.sum(dim=-1, dtype=torch.int32)
    indices_BQK = torch.argsort(dense_BQK.to(torch.uint8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num_BQ[:, None].contiguous(), indices_BQK[:, None].contiguous()


def block_pairs(doc_BT: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per block pair: the gap (Q, K), whether their documents may meet and whether both lie in one (B, Q, K)."""
    B, T = doc_BT.shape
    assert T % block_size == 0, (T, block_size)
    doc_BNS = doc_BT.view(B, T // block_size, block_size)
    first_BN, last_BN = doc_BNS[..., 0], doc_BNS[..., -1]  # ids never decrease along a row
    block_N = torch.arange(T // block_size, device=doc_BT.device)
    gap_QK = block_N[:, None] - block_N[None, :]
    touching_BQK = last_BN[:, None, :] >= first_BN[:, :, None]  # for k block <= q block
    single_doc_BN = first_BN == last_BN
    one_doc_BQK = single_doc_BN[:, :, None] & single_doc_BN[:, None, :] & (first_BN[:, :, None] == first_BN[:, None, :])
    return gap_QK, touching_BQK, one_doc_BQK


def block_mask(doc_BT: Tensor, window: Tensor, block_size: int) -> BlockMask:
    """FlexAttention BlockMask for the rule above (T a multiple of block_size): a block pair inside the window is
    full when the key block lies before the query block in one document, partial where their documents touch."""
    gap_QK, touching_BQK, one_doc_BQK = block_pairs(doc_BT, block_size)
    blocks = window_blocks(window, block_size)
    inside_QK = (gap_QK >= 0) & (gap_QK < blocks)
    full_BQK = inside_QK & (gap_QK > 0) & one_doc_BQK
    partial_BQK = inside_QK & touching_BQK & ~full_BQK

    def mask_mod(b, h, q_idx, kv_idx):
        # the window test is for the unfused path (eager, CPU), which ignores the block lists
        return ((kv_idx <= q_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx])
                & (q_idx // block_size - kv_idx // block_size < blocks))

    kv_num_blocks, kv_indices = _ordered(partial_BQK)
    full_kv_num_blocks, full_kv_indices = _ordered(full_BQK)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod)


@functools.cache
def _compiled_flex_attention():
    # eager flex_attention materialises the full score matrix
    return torch.compile(flex_attention, dynamic=False)


def attend(q_BHTd: Tensor, k_BHTd: Tensor, v_BHTd: Tensor, mask: BlockMask | Tensor, scale: float) -> Tensor:
    """Attention under `mask`: FlexAttention for a BlockMask, SDPA for a dense boolean mask. Returns (B, H, T, d)."""
    if isinstance(mask, BlockMask):
        if q_BHTd.is_cuda and not torch.compiler.is_compiling():
            flex = _compiled_flex_attention()
        else:  # CPU, or inside a compiled region that fuses it
            flex = flex_attention
        return flex(q_BHTd, k_BHTd, v_BHTd, block_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, attn_mask=mask, scale=scale)
