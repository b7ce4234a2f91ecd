"""INT8/FP8 attention (model/fast/attention_kernels.py) against references.

`reference` is the kernel's math in torch (quantize, smooth, the online softmax key block by key block, e4m3 P and
V). It is checked against exact fp64 attention under the mask rule in two ways: every element within the worst case
(`error_bound`), and the root-mean-square error near the one the rounding analysis predicts (`predicted_variance`),
so that neither a missing rounding nor an extra one passes. The Triton kernel runs in the interpreter on the CPU (a
child pytest; tests/helpers.py) and on the GPU (`pytest -m gpu`), against `reference` and the analysis; FastGPT's
per-layer choice runs in the interpreter too.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import Int8Scales, int8_error_bound, int8_error_variance, interpreted, interpreter_parent
from model.attention import dense_mask, document_ids

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast.attention_kernels import E4M3_MAX, Int8Mask, first_key_blocks, quantize

gpu = pytest.mark.gpu
BOS, SCALE = 0, 0.12  # SCALE: the record's attention scale


def reference(q_BTHd, k_BTHd, v_BTHd, doc_BT, blocks: int, S: int, scale: float) -> torch.Tensor:
    """The kernel's math in torch, fp32, key block by key block with the running max: (B, T, H, d) fp32."""
    B, T, H, d = q_BTHd.shape
    N = T // S
    ops = quantize(q_BTHd, k_BTHd, v_BTHd, S)
    log2_scale = scale * math.log2(math.e)
    dq_BNHSd = (ops["q8"].float().view(B, N, S, H, d) * ops["q_scale"][:, :, None, :, None]).transpose(2, 3)
    k_BNHSd = (ops["k8"].float().view(B, N, S, H, d) * ops["k_scale"][:, :, None, :, None]).transpose(2, 3)
    first_BN = first_key_blocks(doc_BT, S)
    pos_T = torch.arange(T)
    out = torch.empty(B, N, H, S, d)
    for b in range(B):
        for m in range(N):
            q_rows = slice(m * S, (m + 1) * S)
            row_max, row_sum, acc = torch.full((H, S), -1e30), torch.zeros(H, S), torch.zeros(H, S, d)
            for n in range(max(m - blocks + 1, int(first_BN[b, m])), m + 1):
                k_rows = slice(n * S, (n + 1) * S)
                s_HSS = (dq_BNHSd[b, m] + ops["q_mean"][b, m][:, None, :]) @ k_BNHSd[b, n].mT * log2_scale
                visible = ((doc_BT[b, q_rows, None] == doc_BT[b, None, k_rows])
                           & (pos_T[q_rows, None] >= pos_T[None, k_rows]))
                s_HSS = s_HSS.masked_fill(~visible, -math.inf)
                new_max = torch.maximum(row_max, s_HSS.amax(dim=-1))
                p_HSS = torch.exp2(s_HSS - new_max[..., None])
                alpha = torch.exp2(row_max - new_max)
                row_sum = row_sum * alpha + p_HSS.sum(dim=-1)
                p8_HSS = (p_HSS * E4M3_MAX).to(torch.float8_e4m3fn).float()
                acc = acc * alpha[..., None] + p8_HSS @ ops["v8t"][b, :, :, k_rows].float().mT
                row_max = new_max
            out[b, m] = acc / row_sum[..., None] * (ops["v_scale"][b][:, None, :] / E4M3_MAX)
    return out.transpose(2, 3).reshape(B, T, H, d)


def exact_attention(q_BTHd, k_BTHd, v_BTHd, visible_BTT, scale: float) -> torch.Tensor:
    """fp64 softmax attention under the token-level mask: (B, T, H, d)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q_BTHd, k_BTHd, v_BTHd))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible_BTT[:, None], scale=scale).transpose(1, 2)


def kernel_scales(q_BTHd, k_BTHd, v_BTHd, S) -> Int8Scales:
    """quantize's scales per token: its query and key blocks' INT8 scales, the rounded k', V's scales."""
    ops = quantize(q_BTHd, k_BTHd, v_BTHd, S)
    q_scale_BTH, k_scale_BTH = (ops[name].double().repeat_interleave(S, dim=1) for name in ("q_scale", "k_scale"))
    return Int8Scales(q_scale_BTH, k_scale_BTH, ops["k8"].double() * k_scale_BTH[..., None], ops["v_scale"].double())


def error_bound(q_BTHd, k_BTHd, v_BTHd, visible_BTT, S: int, scale: float) -> torch.Tensor:
    """A bound (B, T, H, d) on |reference - exact attention|: helpers.int8_error_bound with quantize's scales."""
    return int8_error_bound(q_BTHd, v_BTHd, visible_BTT, kernel_scales(q_BTHd, k_BTHd, v_BTHd, S), scale)


def predicted_variance(q_BTHd, k_BTHd, v_BTHd, visible_BTT, S: int, scale: float) -> torch.Tensor:
    """The variance (B, T, H, d) of reference - exact attention: helpers.int8_error_variance with quantize's
    scales."""
    return int8_error_variance(q_BTHd, k_BTHd, v_BTHd, visible_BTT, kernel_scales(q_BTHd, k_BTHd, v_BTHd, S), scale)


def layouts(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """Token rows with documents of many lengths: short ones, one over a block edge, tokens before the first BOS."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (B, T), generator=g)
    tokens[0, [0, T // 5, T * 3 // 5, T * 3 // 5 + 1]] = BOS  # a one-token document among them
    if B > 1:
        tokens[1, [T // 2 - 56]] = BOS  # row 1 starts mid-document
    return tokens


def operands(B: int, T: int, H: int, d: int, seed: int = 0, device="cpu", offset: float = 2.0):
    """bf16 q, k, v (B, T, H, d): q and k RMS-normed per head (QK-norm) around a shared offset direction of size
    `offset`, as trained heads have, which smoothing takes out; v standard normal."""
    g = torch.Generator(device).manual_seed(seed)

    def normed():
        x = torch.randn(B, T, H, d, generator=g, device=device) + offset * torch.randn(d, generator=g, device=device)
        return x / x.pow(2).mean(-1, keepdim=True).sqrt()
    return normed().bfloat16(), normed().bfloat16(), torch.randn(B, T, H, d, generator=g, device=device).bfloat16()


def visible(tokens_BT: torch.Tensor, blocks: int, S: int) -> torch.Tensor:
    return dense_mask(document_ids(tokens_BT, BOS), torch.tensor(blocks * S), S)[:, 0]


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("d, blocks, offset", [(64, 2, 2.0), (128, 4, 0.5), (32, 1, 4.0)])
def test_reference_within_the_bound_and_near_the_predicted_error(d, blocks, offset):
    """Every element within error_bound; the RMS error 0.8-1.1 times the predicted one (the prediction takes P
    relative to the row's final max, the kernel's running max makes its steps a little finer)."""
    B, T, H, S = 2, 512, 2, 128
    tokens = layouts(B, T)
    q, k, v = operands(B, T, H, d, offset=offset)
    mask = visible(tokens, blocks, S)
    exact = exact_attention(q, k, v, mask, SCALE)
    error = reference(q, k, v, document_ids(tokens, BOS), blocks, S, SCALE).double() - exact
    bound = error_bound(q, k, v, mask, S, SCALE)
    assert (error.abs() <= bound).all(), (error.abs() / bound).max()
    ratio = rms(error) / predicted_variance(q, k, v, mask, S, SCALE).mean().sqrt().item()
    assert 0.8 <= ratio <= 1.1, ratio


def test_smoothing_takes_out_a_common_key_offset():
    """K's mean is subtracted before INT8: adding one vector to every key (in fp32) leaves the output as it was, to
    far below the quantization's error, as it leaves exact attention (the softmax ignores a per-query constant)."""
    B, T, H, d, S = 1, 256, 2, 64, 128
    tokens = layouts(B, T)
    q, k, v = (x.float() for x in operands(B, T, H, d))
    doc = document_ids(tokens, BOS)
    shifted = k + 3.0 * torch.randn(d, generator=torch.Generator().manual_seed(5))
    base = reference(q, k, v, doc, 2, S, SCALE)
    quantization_error = rms(base.double() - exact_attention(q, k, v, visible(tokens, 2, S), SCALE))
    assert rms(reference(q, shifted, v, doc, 2, S, SCALE) - base) <= 0.01 * quantization_error


def test_first_key_blocks_is_the_block_of_the_first_querys_document_start():
    S, T = 16, 256
    tokens = layouts(3, T, seed=3)
    tokens[2, :] = 7  # no BOS at all: one document
    doc = document_ids(tokens, BOS)
    got = first_key_blocks(doc, S)
    for b in range(3):
        for m in range(T // S):
            start = next(t for t in range(T) if doc[b, t] == doc[b, m * S])  # its document's first token
            assert got[b, m] == start // S


@interpreted
@pytest.mark.parametrize("d, blocks", [(64, 2), (32, 8)])
def test_interpreted_kernel_is_the_reference(d, blocks):
    """The kernel's output is the reference's to bf16 rounding (and a rare e4m3 rounding flip): its distance from
    the reference is a fraction of the quantization's own error, which matches the prediction as the reference's."""
    B, T, H, S = 2, 512, 2, 128
    tokens = layouts(B, T)
    q, k, v = operands(B, T, H, d)
    doc, mask = document_ids(tokens, BOS), visible(tokens, blocks, S)
    out = Int8Mask(None, doc, first_key_blocks(doc, S), torch.tensor(blocks), S).attend(q, k, v, SCALE)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = reference(q, k, v, doc, blocks, S, SCALE)
    exact = exact_attention(q, k, v, mask, SCALE)
    assert rms(out.double() - ref.double()) <= 0.15 * rms(ref.double() - exact)
    predicted = predicted_variance(q, k, v, mask, S, SCALE).mean().sqrt().item()
    assert 0.8 <= rms(out.double() - exact) / predicted <= 1.1


@interpreted
def test_interpreted_fast_gpt_chooses_and_uses_int8_layers():
    """FastGPT (model/fast) in a forward-only pass: the per-layer errors are small and positive; with every layer on
    INT8/FP8 the loss is within 1% of FlexAttention's, with every layer off it is FlexAttention's exactly, and a
    training pass (autograd on) never takes the INT8 path."""
    from model.config import GPTConfig
    from model.fast.gpt import FastGPT

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, bos_id=BOS, num_layers=4, model_dim=64, num_heads=2, head_dim=32, num_value_embeds=1,
                       block_size=128)
    model = FastGPT(config)
    model.init_weights()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj_w.normal_(std=0.05)
            block.mlp.proj_w.normal_(std=0.05)
        model.head.weight.normal_(std=0.5)
    model.compute_dtype, model.attention_backend = torch.float32, "flex"  # CPU FlexAttention: forward only
    tokens = torch.randint(1, 128, (2, 512), generator=torch.Generator().manual_seed(1))
    tokens[:, [0, 200]] = BOS
    targets = torch.roll(tokens, -1, dims=1).long()
    window = torch.tensor(256)

    errors = model.int8_attention_errors(tokens, window)
    assert len(errors) == 4 and all(0 < e < 0.1 for e in errors), errors
    with torch.no_grad():
        flex = model.scored_loss_sum(tokens, targets, window)
        model.use_int8_attention([True] * 4)
        int8 = model.scored_loss_sum(tokens, targets, window)
        model.use_int8_attention([False] * 4)
        off = model.scored_loss_sum(tokens, targets, window)
    assert abs(int8 - flex) / flex < 0.01 and int8 != flex
    assert off == flex
    model.use_int8_attention([True] * 4)
    masks, _, _ = model.attention_inputs(tokens, window)  # autograd on: a training pass
    assert not any(isinstance(m, Int8Mask) for m in masks.values())


test_kernels_in_the_triton_interpreter = interpreter_parent(__file__, passed=3)


@gpu
def test_kernel_on_the_gpu_at_the_records_shapes():
    """At the record's head shape (6 heads of 128) over 4,096 tokens with documents, the record's last window of 14
    blocks (1,792 tokens) and its short half: the kernel against exact attention within the predicted RMS error."""
    B, T, H, d, S = 1, 4096, 6, 128, 128
    tokens = torch.randint(1, 50_000, (B, T), generator=torch.Generator().manual_seed(0))
    tokens[0, torch.randint(0, T, (8,), generator=torch.Generator().manual_seed(1))] = BOS
    tokens = tokens.cuda()
    q, k, v = operands(B, T, H, d, device="cuda")
    doc = document_ids(tokens, BOS)
    for blocks in (14, 7):
        out = Int8Mask(None, doc, first_key_blocks(doc, S), torch.tensor(blocks, device="cuda"), S).attend(
            q, k, v, SCALE)
        mask = visible(tokens, blocks, S)
        predicted = predicted_variance(q, k, v, mask, S, SCALE).mean().sqrt().item()
        assert 0.8 <= rms(out.double() - exact_attention(q, k, v, mask, SCALE)) / predicted <= 1.1
