"""model/fast/int8_decode.py, the KV cache (model/decode.py) with it and sample.py --attention_forward int8.

int8_scores and int8_attend against exact fp64 attention under the cache's masks: every element within the worst case
and the RMS error near the predicted one (helpers' rounding analysis, the scales recomputed here from the rule), so
that neither a missing rounding nor a coarser one passes; the scores alone as well, since e4m3's rounding of P and V
outweighs INT8's in the output. The cache with INT8/FP8 layers against the SDPA cache; sample.py's per-layer rule.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import sample
from evals.validation import INT8_MAX_ERROR
from helpers import Int8Scales, int8_error_bound, int8_error_variance, int8_score_bound, int8_score_variance
from model import decode
from model.attention import document_ids
from model.decode import KVCache, window_mask
from model.fast.int8_decode import int8_attend, int8_scores
from test_decode import WINDOW, model, tokens_with_documents  # noqa: F401  (model: test_decode's random models)
from test_sample import PROMPT, checkpoint  # noqa: F401  (checkpoint: a fixture)

BOS, SCALE = 0, 0.12  # SCALE: the record's attention scale


def operands(B: int, T: int, K: int, H: int, d: int, seed: int, offset: float):
    """bf16 q (B, T, H, d) and k, v (B, K, H, d): q and k RMS-normed per head (QK-norm) around a shared offset
    direction of size `offset`, as trained heads have; v normal, each channel's size between 1/4 and 4."""
    g = torch.Generator().manual_seed(seed)

    def normed(n):
        x = torch.randn(B, n, H, d, generator=g) + offset * torch.randn(d, generator=g)
        return x / x.pow(2).mean(-1, keepdim=True).sqrt()
    v_size_d = 4.0 ** (2 * torch.rand(d, generator=g) - 1)
    return normed(T).bfloat16(), normed(K).bfloat16(), (torch.randn(B, K, H, d, generator=g) * v_size_d).bfloat16()


def cache_mask(B: int, T: int, K: int, S: int, blocks: int) -> tuple[torch.Tensor, int]:
    """The cache's mask (B, 1, T, K') for the last T of K tokens with documents (one starting 3 tokens before the
    queries, row 1's halfway), and its first key: K' = K - first key keys from the window's first block on."""
    tokens = torch.randint(1, 50, (B, K), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = BOS
    tokens[0, [K // 3, K - T - 3]] = BOS
    tokens[1:, K // 2] = BOS
    first_key = max(0, ((K - T) // S - blocks + 1) * S)
    return window_mask(document_ids(tokens, BOS), first_key, K - T, blocks, S), first_key


def exact_attention(q_BTHd, k_BKHd, v_BKHd, mask_B1TK, scale: float) -> torch.Tensor:
    """fp64 softmax attention under the mask: (B, T, H, d)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q_BTHd, k_BKHd, v_BKHd))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TK, scale=scale).transpose(1, 2)


def decode_scales(q_BTHd, k_BKHd, v_BKHd, S: int) -> Int8Scales:
    """int8_attend's scales by its rule, in fp64: q's per token, k''s per block of S keys (k' = k - its mean over the
    keys), V's per channel."""
    K = k_BKHd.size(1)
    q_scale_BTH = q_BTHd.double().abs().amax(-1) / 127
    k_BKHd = k_BKHd.double() - k_BKHd.double().mean(dim=1, keepdim=True)
    absmax_BHNS = F.pad(k_BKHd.abs().amax(-1).transpose(1, 2), (0, -K % S)).unflatten(-1, (-1, S))
    k_scale_BKH = (absmax_BHNS.amax(-1) / 127).repeat_interleave(S, dim=-1)[..., :K].transpose(1, 2)
    k_hat_BKHd = torch.round(k_BKHd / k_scale_BKH[..., None]) * k_scale_BKH[..., None]
    return Int8Scales(q_scale_BTH, k_scale_BKH, k_hat_BKHd, v_BKHd.double().abs().amax(dim=1) / 448)


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("K, d, S, offset", [(300, 64, 64, 2.0), (200, 32, 16, 0.0)])
def test_int8_scores_within_the_bound_and_near_the_predicted_error(K, d, S, offset):
    """Each query's scores plus its smoothing's constant q mean(k) scale against q k scale in fp64: every one within
    int8_score_bound (fp32's roundings of k' and of the scale products, 1e-7 relative, inside its 0.1% margin), the
    RMS error 0.9-1.1 times int8_score_variance's."""
    B, T, H = 2, 8, 4
    q, k, _ = operands(B, T, K, H, d, seed=3, offset=offset)
    q64_BHTd, k64_BHKd = q.double().transpose(1, 2), k.double().transpose(1, 2)
    smoothing_BHT1 = SCALE * q64_BHTd @ k64_BHKd.mean(dim=2)[..., None]
    error = int8_scores(q, k, SCALE, S).double() + smoothing_BHT1 - SCALE * q64_BHTd @ k64_BHKd.mT
    scales = decode_scales(q, k, k, S)  # V's scales unused
    assert (error.abs() <= 1.001 * int8_score_bound(q, scales, SCALE)).all()
    ratio = rms(error) / int8_score_variance(q, scales, SCALE).mean().sqrt().item()
    assert 0.9 <= ratio <= 1.1, ratio


# a decode step (one query per row) and prefill chunks; keys from the window's first block, the last block partial
SHAPES = [(8, 1, 300, 64, 64, 3, 2.0), (2, 40, 300, 64, 64, 3, 0.0), (2, 40, 200, 32, 16, 4, 0.5),
          (8, 1, 200, 32, 16, 8, 0.0)]


@pytest.mark.parametrize("B, T, K, d, S, blocks, offset", SHAPES)
def test_int8_attend_within_the_bound_and_near_the_predicted_error(B, T, K, d, S, blocks, offset):
    """Every element within int8_error_bound; the RMS error 0.8-1.1 times the predicted one (the analysis takes each
    rounding as uniform over its step, and values at their block's absmax round exactly)."""
    H = 4
    q, k, v = operands(B, T, K, H, d, seed=0, offset=offset)
    mask, first_key = cache_mask(B, T, K, S, blocks)
    k, v = k[:, first_key:], v[:, first_key:]
    out = int8_attend(q, k, v, mask, SCALE, S)
    assert out.dtype == q.dtype and out.shape == q.shape
    error = out.double() - exact_attention(q, k, v, mask, SCALE)
    scales = decode_scales(q, k, v, S)
    bound = int8_error_bound(q, v, mask[:, 0], scales, SCALE)
    assert (error.abs() <= bound).all(), (error.abs() / bound).max()
    ratio = rms(error) / int8_error_variance(q, k, v, mask[:, 0], scales, SCALE).mean().sqrt().item()
    assert 0.8 <= ratio <= 1.1, ratio


def test_smoothing_takes_out_a_common_key_offset():
    """K's mean is subtracted before INT8: keys sharing an offset 8 times their own size still meet the bound, and
    the output is the unshifted keys' to far below the quantization's error, as exact attention is unchanged."""
    B, T, K, H, d, S = 2, 40, 300, 4, 64, 64
    q, k, v = (x.float() for x in operands(B, T, K, H, d, seed=2, offset=2.0))
    mask, first_key = cache_mask(B, T, K, S, blocks=3)
    k, v = k[:, first_key:], v[:, first_key:]
    shifted = k + 8.0 * torch.randn(d, generator=torch.Generator().manual_seed(5))
    base = int8_attend(q, k, v, mask, SCALE, S)
    quantization_error = rms(base.double() - exact_attention(q, k, v, mask, SCALE))
    out = int8_attend(q, shifted, v, mask, SCALE, S)
    # k + offset in fp32 moves a few values across an INT8 or e4m3 rounding edge: 1-3% of the error (150% unsmoothed)
    assert rms(out - base) <= 0.05 * quantization_error
    error = out.double() - exact_attention(q, shifted, v, mask, SCALE)
    assert (error.abs() <= int8_error_bound(q, v, mask[:, 0], decode_scales(q, shifted, v, S), SCALE)).all()


def cached_logits(model, tokens_BT: torch.Tensor, prompt_len: int, window: int, **int8):
    """A cache's logits (B, T, V), the prompt in one call (of several chunks), then one token at a time; the cache."""
    cache = KVCache(model, tokens_BT.size(0), tokens_BT.size(1), window, **int8)
    pieces = [tokens_BT[:, :prompt_len]] + list(tokens_BT[:, prompt_len:].split(1, dim=1))
    with torch.no_grad():
        return torch.cat([model.head.logits(cache.extend(piece)) for piece in pieces], dim=1), cache


def test_an_int8_cache_stays_near_the_sdpa_cache(model, monkeypatch):
    """Every attention layer in INT8/FP8, a prompt of 60 tokens read in chunks of 7, then 40 single tokens, with
    documents and a window (48 tokens) shorter than the context: the logits stay within rounding of the SDPA
    cache's, far nearer than a wrong window would put them."""
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 7)
    tokens = tokens_with_documents(rows=2, length=100, bos_at=[13, 30, 71], seed=1)
    layers = [i for i, block in enumerate(model.blocks) if block.attn is not None]
    sdpa, _ = cached_logits(model, tokens, 60, WINDOW)
    distance = rms(cached_logits(model, tokens, 60, WINDOW, int8_layers=layers)[0] - sdpa)
    # logits of RMS 6.5: INT8/FP8 moves them by 0.08, a window 4 times as wide by 1.1
    assert 0 < distance < 0.2
    assert rms(cached_logits(model, tokens, 60, 4 * WINDOW)[0] - sdpa) > 5 * distance


def test_measuring_keeps_the_sdpa_output_and_sums_each_layers_error(model, monkeypatch):
    """With measure_int8 the logits are the SDPA cache's bit for bit, and each attention layer's error over the
    chunks of a prefill and the single tokens after it is positive and small."""
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 7)
    tokens = tokens_with_documents(rows=2, length=60, bos_at=[13, 30], seed=2)
    measured, cache = cached_logits(model, tokens, 50, WINDOW, measure_int8=True)
    assert torch.equal(measured, cached_logits(model, tokens, 50, WINDOW)[0])
    errors = cache.int8_errors()
    assert sorted(errors) == [i for i, block in enumerate(model.blocks) if block.attn is not None]
    assert all(0 < e < INT8_MAX_ERROR for e in errors.values()), errors


def test_sample_int8_measures_once_and_keeps_its_layers_past_a_full_context(checkpoint, capsys, monkeypatch):
    """sample.py --attention_forward int8: the layer line on stderr and the text; one measuring prefill, then every
    cache, those a full context restarts included, takes the chosen layers."""
    made = []

    class RecordedCache(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((self.int8_layers, self.int8_l1 is not None))
    monkeypatch.setattr(sample, "KVCache", RecordedCache)
    prompt = " fox" * 120  # 121 tokens with BOS: the 128-token context fills at the 7th new one
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", prompt, "--max_new_tokens", "12", "--device",
                        "cpu", "--attention_forward", "int8"]) == 0
    out, err = capsys.readouterr()
    assert re.fullmatch(rf"int8 attention in 2 of 2 layers; relative L1 error by layer \(bf16 where over "
                        rf"{INT8_MAX_ERROR}\): 0\.0\d\d\d 0\.0\d\d\d\n", err), err
    assert out.startswith(prompt) and len(out) > len(prompt) + 1
    assert made[0] == (set(), True) and len(made) > 3 and all(m == ({0, 1}, False) for m in made[1:])


def test_layers_over_the_threshold_stay_bf16(checkpoint, capsys, monkeypatch):
    """bf16 is the default and prints no layer line; with every layer over INT8_MAX_ERROR (0), int8 samples the
    bf16 text exactly (INT8/FP8 layers move the logits: test_an_int8_cache_stays_near_the_sdpa_cache)."""
    args = ["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--max_new_tokens", "12", "--device", "cpu"]
    assert sample.main(args) == 0
    default = capsys.readouterr()
    assert default.err == "" and sample.main(args + ["--attention_forward", "bf16"]) == 0
    assert capsys.readouterr().out == default.out
    monkeypatch.setattr("evals.validation.INT8_MAX_ERROR", 0.0)
    assert sample.main(args + ["--attention_forward", "int8"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("int8 attention in 0 of 2 layers; relative L1 error by layer (bf16 where over 0.0): ")
    assert out == default.out
    with pytest.raises(SystemExit):
        sample.main(args + ["--attention_forward", "fp8"])
