"""The U-net skip's autograd.Function (model/fast/routing.py, SkipAdd) against autograd through x + w s, and the
Triton kernels of model/fast/skip_kernels.py against fp64 torch ops.

The kernels run on a GPU (`pytest -m gpu`) at the training's size, and on the CPU through the Triton interpreter
where triton is installed, in a child pytest (`test_kernels_in_the_triton_interpreter`; see tests/helpers.py)."""

import pytest
import torch

from helpers import interpreted, interpreter_parent, output_and_grads as grads

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast import skip_kernels
from model.fast.routing import SkipAdd, skip_add

gpu = pytest.mark.gpu


def operands(shape, dtype, device, seed=0):
    """x, s and the upstream gradient g in dtype, and an fp32 weight w of 0.8 (its init is 1; a value off 1 catches
    a kernel that forgets it)."""
    gen = torch.Generator(device).manual_seed(seed)
    x, s, g = (torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(3))
    return x, s, torch.tensor(0.8, device=device), g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_function_matches_autograd(dtype):
    """On the CPU the Function's torch ops give autograd's values, to rounding."""
    args = operands((2, 5, 16), dtype, "cpu")
    for got, want in zip(grads(SkipAdd.apply, *args), grads(skip_add, *args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=1e-6)


def test_function_with_the_stream_as_its_own_skip():
    """The middle block's skip is the residual stream itself (FastGPT.hidden_states): x + w x, whose gradient for x
    is g + w g, summed by autograd over the Function's two inputs."""
    x, _, w, g = operands((3, 7), torch.float64, "cpu")
    x, w = x.requires_grad_(), w.double().requires_grad_()
    SkipAdd.apply(x, x, w).backward(g)
    torch.testing.assert_close(x.grad, (1 + w.detach()) * g)
    torch.testing.assert_close(w.grad, (g * x.detach()).sum())


def check_kernels(shape, device, rtol):
    """skip_add and skip_add_grad on bf16 tensors against fp64 torch ops: each bf16 result within one rounding
    (rtol) of the exact value, or 1e-6 where x + w s cancels (the fp32 w s is rounded before the sum; the
    operands are ~N(0, 1)); the weight's gradient, a sum of 10^3 to 10^7 products, within 1e-4 of the sum
    of their magnitudes (fp32 partial sums)."""
    x, s, w, g = operands(shape, torch.bfloat16, device)
    out = skip_kernels.skip_add(x, s, w)
    want = x.double() + w.double() * s.double()
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=1e-6)
    grad_s, grad_w = skip_kernels.skip_add_grad(g, s, w)
    torch.testing.assert_close(grad_s.double(), w.double() * g.double(), rtol=rtol, atol=1e-30)
    products = g.double() * s.double()
    assert grad_w.dtype == torch.float32 and grad_w.dim() == 0
    assert abs(grad_w.double() - products.sum()) < 1e-4 * products.abs().sum()


@gpu
@pytest.mark.parametrize("shape", [(1, 49152, 768), (3, 111, 77)])
def test_kernels_on_gpu(shape):
    """The record's micro-batch, and 25,641 elements: 6 blocks of 4,096 and a partial one."""
    check_kernels(shape, "cuda", rtol=2.0 ** -8)


@gpu
def test_function_on_gpu_matches_autograd_and_repeats():
    """On the kernels, the Function against autograd's bf16 ops, both against fp64: each result at least as close to
    fp64 as autograd's (fp32 arithmetic, one rounding), and the weight's gradient the same bits on a second run."""
    args = operands((2, 4096, 768), torch.bfloat16, "cuda")
    exact = grads(skip_add, *[t.double() for t in args])
    got = grads(SkipAdd.apply, *args)
    for mine, own, want in zip(got, grads(skip_add, *args), exact, strict=True):
        assert (mine.double() - want).abs().max() <= (own.double() - want).abs().max()
    assert torch.equal(got[3], grads(SkipAdd.apply, *args)[3])


# --- CPU, Triton interpreter --------------------------------------------------------------------------------------
test_kernels_in_the_triton_interpreter = interpreter_parent(__file__, 1)


@interpreted
def test_interpreted_kernels():
    """25,641 elements: 6 blocks and a partial one. The interpreter rounds fp32 -> bf16 by truncation (the GPU to
    nearest): within 2^-7, not 2^-8."""
    check_kernels((3, 111, 77), "cpu", rtol=2.0 ** -7)
