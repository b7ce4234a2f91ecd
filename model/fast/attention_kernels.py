"""INT8/FP8 attention for forward-only passes (validation, HellaSwag), after SageAttention2, under model/attention.py's
rule (document-causal, a window of whole blocks). Per head, with S-token blocks of queries and keys:

- K is smoothed, k' = k - mean(k) over the row's tokens: each query's scores shift by one constant, so the softmax
  is unchanged. Q is smoothed per query block m, q = q_m + dq, and s = dq k' + q_m k': the second term is a GEMV in
  fp32 (`bias`), which leaves INT8 only dq, whose range lacks the block's common offset.
- dq and k' go to INT8 with one scale per block (absmax / 127); dq k' runs as an INT8 product into int32.
- P = exp2(s - running row max), in [0, 1], goes to e4m3 as 448 P; V to e4m3 with one scale per channel
  (absmax / 448); P V accumulates in fp32, and the row sums use P before rounding.

`quantize` prepares the kernel's operands in torch ops. The kernel runs one program per (query block, batch row and
head): an online softmax over the key blocks that its window and its first query's document reach.
`int8_attention_op` is its torch.library op, so that compiled blocks call it; `Int8Mask` carries what it reads of a
batch. tests/test_int8_attention.py holds the same math in torch and its error against exact attention.

Shape legend: as model/gpt.py; N = T // S blocks.
"""
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op
from torch.nn.attention.flex_attention import BlockMask

from model.config import window_blocks
from model.fast.int8_decode import E4M3_MAX, INT8_MAX, TINY
from model.fast.launch import launcher


def quantize(q_BTHd: Tensor, k_BTHd: Tensor, v_BTHd: Tensor, block_size: int) -> dict[str, Tensor]:
    """The kernel's operands: q8, k8 (B, T, H, d) int8 with scales q_scale, k_scale (B, N, H) and the query blocks'
    means q_mean (B, N, H, d) fp32; v8t (B, H, d, T) e4m3 (keys contiguous, the layout FP8 products read) with
    v_scale (B, H, d). Dequantized: dq = q8 q_scale, k' = k8 k_scale, v = v8t v_scale."""
    B, T, H, d = q_BTHd.shape
    N, S = T // block_size, block_size
    q_BNSHd = q_BTHd.float().view(B, N, S, H, d)
    q_mean_BNHd = q_BNSHd.mean(dim=2)
    dq_BNSHd = q_BNSHd - q_mean_BNHd[:, :, None]
    q_scale_BNH = dq_BNSHd.abs().amax(dim=(2, 4)).clamp_min(TINY) / INT8_MAX
    q8 = torch.round(dq_BNSHd / q_scale_BNH[:, :, None, :, None]).to(torch.int8).view(B, T, H, d)
    k_BTHd = k_BTHd.float()
    k_BNSHd = (k_BTHd - k_BTHd.mean(dim=1, keepdim=True)).view(B, N, S, H, d)
    k_scale_BNH = k_BNSHd.abs().amax(dim=(2, 4)).clamp_min(TINY) / INT8_MAX
    k8 = torch.round(k_BNSHd / k_scale_BNH[:, :, None, :, None]).to(torch.int8).view(B, T, H, d)
    v_scale_BHd = v_BTHd.float().abs().amax(dim=1).clamp_min(TINY) / E4M3_MAX
    v8t = (v_BTHd.float() / v_scale_BHd[:, None]).to(torch.float8_e4m3fn).permute(0, 2, 3, 1).contiguous()
    return {"q8": q8, "q_scale": q_scale_BNH, "q_mean": q_mean_BNHd, "k8": k8, "k_scale": k_scale_BNH,
            "v8t": v8t, "v_scale": v_scale_BHd}


def first_key_blocks(doc_BT: Tensor, block_size: int) -> Tensor:
    """(B, N) int32: for each query block, the first key block holding a token of its first query's document; no
    query of the block sees a key before it."""
    first_doc_BN = doc_BT[:, ::block_size].contiguous()
    last_doc_BN = doc_BT[:, block_size - 1::block_size].contiguous()  # ids never decrease along a row
    return torch.searchsorted(last_doc_BN, first_doc_BN).to(torch.int32)


_WARPS, _STAGES = 8, 2


@triton.jit
def _to_e4m3(x, EXACT: tl.constexpr):
    """x (>= 0) in e4m3, rounded to nearest. The interpreter's conversion mis-rounds values next to a power of two,
    so under it x is first rounded onto e4m3's grid in fp32, which its conversion then keeps."""
    if EXACT:
        bits = x.to(tl.int32, bitcast=True)
        # to nearest even at 3 mantissa bits: 20 low bits dropped, a carry may raise the exponent
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        x = tl.where(x < 0.015625, tl.floor(x * 512.0 + 0.5) / 512.0, normal)  # subnormals: steps of 2^-9
    return x.to(tl.float8e4nv)


@triton.jit
def _key_block(n, q, q_scale, q_mean, q_pos, doc_q, row_max, row_sum, acc, k_ptr, k_scale_ptr, v_ptr, doc_ptr, row0,
               v_row0, b, h, T, N, H: tl.constexpr, D: tl.constexpr, S: tl.constexpr, EXACT_FP8: tl.constexpr):
    """The online softmax's step over key block n: (row_max, row_sum, acc) updated."""
    rows, cols = tl.arange(0, S), tl.arange(0, D)
    k_pos = n * S + rows
    k = tl.load(k_ptr + ((row0 + k_pos)[:, None] * H + h) * D + cols[None, :])
    k_scale = tl.load(k_scale_ptr + (b.to(tl.int64) * N + n) * H + h)
    # dq k' in int32, then q_mean k' (the smoothing's bias, one value per key) in fp32
    s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * (q_scale * k_scale)
    s += (tl.sum(k.to(tl.float32) * q_mean[None, :], axis=1) * k_scale)[None, :]
    doc_k = tl.load(doc_ptr + row0 + k_pos)
    visible = (doc_q[:, None] == doc_k[None, :]) & (q_pos[:, None] >= k_pos[None, :])
    s = tl.where(visible, s, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(s, axis=1))
    p = tl.math.exp2(s - new_max[:, None])
    alpha = tl.math.exp2(row_max - new_max)
    v = tl.load(v_ptr + v_row0 + cols[:, None] * T + k_pos[None, :])  # (D, S): keys contiguous
    pv = tl.dot(_to_e4m3(p * 448.0, EXACT_FP8), tl.trans(v), out_dtype=tl.float32)
    return new_max, row_sum * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _int8_attention_kernel(q_ptr, q_scale_ptr, q_mean_ptr, k_ptr, k_scale_ptr, v_ptr, v_scale_ptr, doc_ptr,
                           first_ptr, blocks_ptr, out_ptr, T, N, log2_scale, H: tl.constexpr, D: tl.constexpr,
                           S: tl.constexpr, INTERPRET: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows, cols = tl.arange(0, S), tl.arange(0, D)
    row0 = b.to(tl.int64) * T  # (B, T, H, D) tensors: token t of row b at (b T + t) H D
    v_row0 = bh.to(tl.int64) * D * T  # (B, H, D, T)
    q_pos = m * S + rows
    q = tl.load(q_ptr + ((row0 + q_pos)[:, None] * H + h) * D + cols[None, :])
    block_mh = (b.to(tl.int64) * N + m) * H + h
    # in fp32: a compiled launch may pass log2_scale as fp64
    q_scale = (tl.load(q_scale_ptr + block_mh) * log2_scale).to(tl.float32)
    q_mean = (tl.load(q_mean_ptr + block_mh * D + cols) * log2_scale).to(tl.float32)
    doc_q = tl.load(doc_ptr + row0 + q_pos)
    lo = tl.maximum(m - tl.load(blocks_ptr).to(tl.int32) + 1, tl.load(first_ptr + b * N + m))
    row_max = tl.full([S], -1.0e30, tl.float32)  # finite: a row may see no key of its first blocks
    row_sum = tl.zeros([S], tl.float32)
    acc = tl.zeros([S, D], tl.float32)
    if INTERPRET:  # Triton 3.6's interpreter cannot take a tensor as a range's bound
        n = lo
        while n <= m:
            row_max, row_sum, acc = _key_block(n, q, q_scale, q_mean, q_pos, doc_q, row_max, row_sum, acc, k_ptr,
                                               k_scale_ptr, v_ptr, doc_ptr, row0, v_row0, b, h, T, N, H, D, S, True)
            n += 1
    else:
        for n in range(lo, m + 1):
            row_max, row_sum, acc = _key_block(n, q, q_scale, q_mean, q_pos, doc_q, row_max, row_sum, acc, k_ptr,
                                               k_scale_ptr, v_ptr, doc_ptr, row0, v_row0, b, h, T, N, H, D, S, False)
    v_scale = tl.load(v_scale_ptr + bh.to(tl.int64) * D + cols) * (1.0 / 448.0)
    out = acc / row_sum[:, None] * v_scale[None, :]
    tl.store(out_ptr + ((row0 + q_pos)[:, None] * H + h) * D + cols[None, :], out.to(out_ptr.dtype.element_ty))


@triton_op("speedrun::int8_attention", mutates_args=())
def int8_attention_op(q8: Tensor, q_scale: Tensor, q_mean: Tensor, k8: Tensor, k_scale: Tensor, v8t: Tensor,
                      v_scale: Tensor, doc_BT: Tensor, first_BN: Tensor, blocks: Tensor, log2_scale: float
                      ) -> Tensor:
    """The attention (B, T, H, d) in bf16 from `quantize`'s operands; blocks: the window in blocks, a 0-D tensor."""
    B, T, H, d = q8.shape
    N = first_BN.size(1)
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=q8.device)
    launcher(_int8_attention_kernel)[(N, B * H)](
        q8, q_scale, q_mean, k8, k_scale, v8t, v_scale, doc_BT, first_BN, blocks, out, T, N, log2_scale, H=H, D=d,
        S=T // N, INTERPRET=triton.knobs.runtime.interpret, num_warps=_WARPS, num_stages=_STAGES)
    return out


class Int8Mask(NamedTuple):
    """A forward-only pass's mask: FlexAttention's, and what the INT8/FP8 kernel reads instead."""
    flex: BlockMask
    doc_BT: Tensor  # document ids (B, T) int32
    first_BN: Tensor  # first_key_blocks(doc_BT)
    blocks: Tensor  # the window in whole blocks, 0-D
    block_size: int

    @classmethod
    def of(cls, flex: BlockMask, doc_BT: Tensor, window: Tensor, block_size: int) -> "Int8Mask":
        return cls(flex, doc_BT, first_key_blocks(doc_BT, block_size), window_blocks(window, block_size), block_size)

    def attend(self, q_BTHd: Tensor, k_BTHd: Tensor, v_BTHd: Tensor, scale: float) -> Tensor:
        """INT8/FP8 attention of q, k, v (B, T, H, d) under this mask: (B, T, H, d) bf16."""
        ops = quantize(q_BTHd, k_BTHd, v_BTHd, self.block_size)
        return int8_attention_op(ops["q8"], ops["q_scale"], ops["q_mean"], ops["k8"], ops["k_scale"], ops["v8t"],
                                 ops["v_scale"], self.doc_BT, self.first_BN, self.blocks, scale * math.log2(math.e))
