"""INT8/FP8 attention for model/decode.py's KV cache, in torch ops (no triton, so it runs wherever torch does): the
quantization of attention_kernels.py for any number of queries over the cached keys under an explicit mask.

- K is smoothed, k' = k - mean(k) over the given keys (per row and head): each query's scores shift by one constant,
  so the softmax is unchanged. q is not smoothed: its INT8 blocks are single tokens, which have no offset to take out.
- k' goes to INT8 with one scale per block of keys, q with one per token (absmax / 127); their product sums exactly.
- P = exp(s - row max), in [0, 1], goes to e4m3 as 448 P; V to e4m3 with one scale per channel (absmax / 448); P V
  accumulates in fp32, and the row sums use P before rounding.

Shape legend: as model/gpt.py; K keys, N = ceil(K / S) key blocks.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

INT8_MAX, E4M3_MAX = 127.0, 448.0
TINY = 1e-30  # the scale of an all-zero block: its values quantize to 0
FP32_EXACT = 2 ** 24  # fp32 holds every integer up to it: an INT8 product of d < 2^24 / 127^2 terms sums exactly


def int8_scores(q_BTHd: Tensor, k_BKHd: Tensor, scale: float, block_size: int) -> Tensor:
    """The scores (B, H, T, K) fp32 of the queries q (B, T, H, d) against the keys k (B, K, H, d) times `scale`, from
    INT8 q and k': each query's are q k scale less its constant q mean(k) scale, to INT8 rounding. Key blocks of
    block_size start at the first key, the last one possibly partial."""
    B, K, H, d = k_BKHd.shape
    assert d * INT8_MAX ** 2 < FP32_EXACT, f"head_dim {d}: the INT8 product would round in fp32"
    S, N = block_size, math.ceil(K / block_size)
    q_BHTd = q_BTHd.float().transpose(1, 2)
    q_scale_BHT1 = q_BHTd.abs().amax(dim=-1, keepdim=True).clamp_min(TINY) / INT8_MAX
    q8_BHTd = torch.round(q_BHTd / q_scale_BHT1)
    k_BHKd = k_BKHd.float().transpose(1, 2)
    k_BHKd = k_BHKd - k_BHKd.mean(dim=2, keepdim=True)
    absmax_BHNS = F.pad(k_BHKd.abs().amax(dim=-1), (0, N * S - K)).view(B, H, N, S)
    k_scale_BHK = (absmax_BHNS.amax(dim=-1).clamp_min(TINY) / INT8_MAX).repeat_interleave(S, dim=-1)[..., :K]
    k8_BHKd = torch.round(k_BHKd / k_scale_BHK[..., None])
    # the INT8 values stay in fp32, where their product sums exactly (FP32_EXACT): an fp32 matmul on every device
    return (q8_BHTd @ k8_BHKd.mT) * (q_scale_BHT1 * k_scale_BHK[:, :, None] * scale)


def int8_attend(q_BTHd: Tensor, k_BKHd: Tensor, v_BKHd: Tensor, mask_B1TK: Tensor, scale: float,
                block_size: int) -> Tensor:
    """Softmax attention (B, T, H, d) in q's dtype of the queries q over the keys k and values v where the boolean
    mask is True, scores times `scale`, from int8_scores; every query sees at least one key."""
    s_BHTK = int8_scores(q_BTHd, k_BKHd, scale, block_size).masked_fill(~mask_B1TK, -math.inf)
    p_BHTK = torch.exp(s_BHTK - s_BHTK.amax(dim=-1, keepdim=True))
    row_sum_BHT1 = p_BHTK.sum(dim=-1, keepdim=True)
    p8_BHTK = (p_BHTK * E4M3_MAX).to(torch.float8_e4m3fn).float()
    v_BHKd = v_BKHd.float().transpose(1, 2)
    v_scale_BH1d = v_BHKd.abs().amax(dim=2, keepdim=True).clamp_min(TINY) / E4M3_MAX
    v8_BHKd = (v_BHKd / v_scale_BH1d).to(torch.float8_e4m3fn).float()
    out_BHTd = (p8_BHTK @ v8_BHKd) / row_sum_BHT1 * (v_scale_BH1d / E4M3_MAX)
    return out_BHTd.transpose(1, 2).to(q_BTHd.dtype)
