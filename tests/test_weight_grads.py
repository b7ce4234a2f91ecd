"""The hidden matrices' products on fp32 master weights (model/layers.py: Linear for attention's, ReLU2MLP for the
MLP's, both through matmul_to): the output and the activations' gradients exactly as with the weights cast to bf16
first, and the weights' gradients in fp32 within fp32 accumulation of the exact product of the same bf16 operands,
where autograd's bf16 product is rounded a hundred times further off."""
import re

import pytest
import torch
import torch.nn.functional as F

from helpers import output_and_grads as grads
from model import layers

try:
    from model import mlp_kernels
except ImportError:  # CPU-only torch: no triton
    mlp_kernels = None

M, K, N = 256, 64, 192  # rows (tokens), inputs, outputs / hidden units
FP32_BOUND = 1e-5  # largest error / largest value of an fp32 sum of M exact products (at most M * 2^-24 = 1.5e-5)
BF16_FLOOR = 1e-4  # the same for a product rounded to bf16 (2^-9 per value): far above FP32_BOUND


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


def operands(device, seed=0):
    """x (2, M/2, K) bf16, fp32 masters W (N, K), W1 and W2 (K, N), the residual (M, K), upstream gradients."""
    g = torch.Generator(device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    x = randn(2, M // 2, K).bfloat16()
    return dict(x=x, w=randn(N, K) * K ** -0.5, w1=randn(K, N) * K ** -0.5, w2=randn(K, N) * N ** -0.5,
                r=randn(M, K).bfloat16(), grad_lin=randn(2, M // 2, N).bfloat16(), grad_mlp=randn(M, K).bfloat16())


def linear(x, w):
    return layers.Linear.apply(x, w)


def mlp(x, w1, w2, r):
    return layers.ReLU2MLP.apply(x, w1, w2, r)


def exact_weight_grads(o, device):
    """fp64 products of the bf16 operands the weights' gradients come from: for Linear grad_y^T x; for the MLP
    x^T grad_pre and grad_y^T h, with h and grad_pre made by the ops the Function runs on this device."""
    x_MK = o["x"].flatten(0, 1)
    want_w = o["grad_lin"].flatten(0, 1).double().t() @ x_MK.double()
    w1, w2 = o["w1"].bfloat16(), o["w2"].bfloat16()
    ops = mlp_kernels if mlp_kernels is not None and mlp_kernels.supports(x_MK, w1) else layers.TORCH_OPS
    h = ops.relu2_matmul(x_MK, w1)
    grad_pre = ops.relu2_matmul_grad(o["grad_mlp"], w2, h)
    return want_w, x_MK.double().t() @ grad_pre.double(), o["grad_mlp"].double().t() @ h.double()


def check(device):
    o = operands(device)
    x_MK = o["x"].flatten(0, 1)
    got_lin = grads(linear, o["x"], o["w"], o["grad_lin"])
    got_mlp = grads(mlp, x_MK, o["w1"], o["w2"], o["r"], o["grad_mlp"])
    # the same calls with the weights cast to bf16 first: autograd's bf16 products, F.linear's own for Linear
    cast_lin = grads(lambda x, w: F.linear(x, w), o["x"], o["w"].bfloat16(), o["grad_lin"])
    cast_mlp = grads(mlp, x_MK, o["w1"].bfloat16(), o["w2"].bfloat16(), o["r"], o["grad_mlp"])
    torch.testing.assert_close(got_lin[:2], cast_lin[:2], rtol=0, atol=0)  # output, grad_x
    torch.testing.assert_close([got_mlp[i] for i in (0, 1, 4)], [cast_mlp[i] for i in (0, 1, 4)], rtol=0, atol=0)
    want_w, want_w1, want_w2 = exact_weight_grads(o, device)
    for got, cast, want in ((got_lin[2], cast_lin[2], want_w), (got_mlp[2], cast_mlp[2], want_w1),
                            (got_mlp[3], cast_mlp[3], want_w2)):
        assert got.dtype == torch.float32 and cast.dtype == torch.bfloat16
        assert relative_error(got, want) < FP32_BOUND, relative_error(got, want)
        assert relative_error(cast, want) > BF16_FLOOR  # the bound tells the two apart


def test_fp32_masters_get_fp32_gradients_on_cpu():
    check("cpu")


def test_matmul_to():
    """The same dtype is a plain product; bf16 into fp32 is the exact fp32 product of the bf16 values."""
    a, b = torch.randn(8, 16).bfloat16(), torch.randn(16, 4).bfloat16()
    assert torch.equal(layers.matmul_to(a, b, torch.bfloat16), a @ b)
    got = layers.matmul_to(a, b, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, a.float() @ b.float(), rtol=0, atol=0)


def test_module_weights_get_fp32_gradients():
    """Attention's QKV and projection, and the MLP's two matrices, are fp32 masters whose gradients arrive in fp32
    from a bf16 forward."""
    torch.manual_seed(0)
    attn, block_mlp = layers.Attention(64, 2, 32, 0.12), layers.MLP(64, 128)
    for part in (attn, block_mlp):
        part.init_weights()
        with torch.no_grad():
            part.proj_w.normal_()
    x = torch.randn(1, 128, 64).bfloat16()
    cos, sin = layers.rotary_tables(128, 32, 1024.0, torch.device("cpu"))
    mask = torch.ones(128, 128, dtype=torch.bool).tril()
    y, _ = attn(x, x[..., :1], None, None, cos, sin, mask)
    (y.float().square().sum() + block_mlp(x, x).float().square().sum()).backward()
    for w in (attn.qkv_w, attn.proj_w, block_mlp.fc_w, block_mlp.proj_w):
        assert w.dtype == w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch.cuda.is_available() is False")
def test_fp32_masters_get_fp32_gradients_on_gpu():
    """cuBLAS writes the fp32 gradient itself (out_dtype), eager and under torch.compile; the compiled backwards
    launch no Triton kernel: no cast of a bf16 gradient."""
    from torch._inductor.utils import run_and_get_code

    check("cuda")
    o = operands("cuda")
    for fn, args in ((linear, (o["x"], o["w"], o["grad_lin"])),
                     (mlp, (o["x"].flatten(0, 1), o["w1"], o["w2"], o["r"], o["grad_mlp"]))):
        got, codes = run_and_get_code(grads, torch.compile(fn, dynamic=False), *args)
        assert re.findall(r"(\w+)\.run\(", codes[-1]) == [], codes[-1]  # the backward's code
        for a, b in zip(got, grads(fn, *args), strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
