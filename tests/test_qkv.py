"""The attention inputs' autograd.Function (model/fast/blocks.py, QKVPrep, on the Triton kernels of
model/fast/qkv_kernels.py) against autograd through the torch ops of model.gpt.prepare_qkv.

The kernels run on a GPU (`pytest -m gpu`) at the training's size, and on the CPU through the Triton interpreter
where triton is installed, in a child pytest (`test_kernels_in_the_triton_interpreter`; see tests/helpers.py)."""
import re

import pytest
import torch

from helpers import interpreted, interpreter_parent
from model.gpt import prepare_qkv, rotary_tables

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast import qkv_kernels, transpose_kernels
from model.fast.blocks import QKVPrep, qkv_prep_grad_fp8
from model.fast.fp8 import E4M3_MAX, delayed_scale

gpu = pytest.mark.gpu
# which of the optional value inputs a layer has: the record's layers have a value embedding or nothing
PATTERNS = [(False, False), (False, True), (True, True)]


def problem(B, T, H, d, dtype, device, v_first, ve, seed=0):
    """The Function's inputs, with the model's rotary tables, weights off their init values, and the output
    gradients: those of q and k transposed views, as FlexAttention's (B, H, T, d) gradients arrive, and v's every
    other element of a wider tensor (a stride the kernel does not take: the Function copies it)."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    cos, sin = rotary_tables(T, d, 1024.0, torch.device(device))
    inputs = [randn(B, T, 3 * H, d), cos, sin, torch.tensor([0.7, -0.4, 1.3], device=device),
              randn(B, T, H, d) if v_first else None, randn(B, T, H * d) if ve else None]
    grads = [randn(B, H, T, d).transpose(1, 2), randn(B, H, T, d).transpose(1, 2), randn(B, T, H, 2 * d)[..., ::2]]
    return inputs, grads


def run(fn, inputs, grads):
    """Outputs (q, k, v), then the gradients of qkv, the weights and the present value inputs."""
    leaves = [t if t is None else t.detach().requires_grad_(i in (0, 3, 4, 5)) for i, t in enumerate(inputs)]
    outs = fn(*leaves)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [leaves[i].grad for i in (0, 3, 4, 5) if leaves[i] is not None]


def check(B, T, H, d, dtype, device, rtol, atol):
    """Every output and gradient of QKVPrep against fp64 autograd through prepare_qkv, for each pattern of value
    inputs: within rtol of each value plus atol of the largest; the weights' gradients (sums over all rows) within
    1e-5 of their sum's magnitude bound."""
    for v_first, ve in PATTERNS:
        inputs, grads = problem(B, T, H, d, dtype, device, v_first, ve)
        got = run(QKVPrep.apply, inputs, grads)
        exact = run(prepare_qkv, *[[t if t is None else t.double() for t in ts] for ts in (inputs, grads)])
        for i, (a, want) in enumerate(zip(got, exact, strict=True)):
            assert a.dtype == (torch.float32 if i == 4 else dtype) and a.shape == want.shape, i
            if i == 4:  # the weights: a sum over B T H d products
                bound = sum(g.double().abs().sum() * t.double().abs().max()
                            for g, t in zip(grads[2:], inputs[:1] + inputs[4:]) if t is not None)
                assert (a.double() - want).abs().max() < 1e-5 * bound, (a, want)
            else:
                torch.testing.assert_close(a.double(), want, rtol=rtol, atol=atol * want.abs().max().item())


def check_fp8(B, T, H, d, dtype, device, history, rtol, atol, interpreter=False, fn=None):
    """qkv_prep_grad_fp8 on the kernel (or fn, its torch ops) against fp64 autograd through prepare_qkv, for each
    pattern of value inputs, with the amax of the last call at history times this gradient's (1: the true amax; 1/2:
    the largest values saturate): the weights' and value inputs' gradients as check's, and qkv's, given only as an
    e4m3 copy at that delayed scale, within e4m3's rounding (2^-4 relative, or 2^-10 of the scale below its normal
    range) of the exact value clamped to the scale's range, with the amax left at the exact one. Triton 3.6's
    interpreter casts fp32 -> e4m3 with a carry bug (a mantissa that rounds up past 1.875 wraps, halving the value;
    the GPU rounds to nearest), so there each value may instead lie within rounding of half of it."""
    if fn is None:
        fn = qkv_kernels.qkv_prep_grad_fp8
    for v_first, ve in PATTERNS:
        inputs, grads = problem(B, T, H, d, dtype, device, v_first, ve)
        exact = run(prepare_qkv, *[[t if t is None else t.double() for t in ts] for ts in (inputs, grads)])
        g_exact = exact[3].flatten(0, 1).flatten(1)
        amax = (history * g_exact.abs().max()).float().reshape(())
        scale = delayed_scale(amax.clone())
        grads = [g if g.stride(-1) == 1 else g.contiguous() for g in grads]
        g8, got_scale, *others = fn(*grads, *inputs, amax)
        assert g8.dtype == torch.float8_e4m3fn and g8.shape == g_exact.shape and torch.equal(got_scale, scale)
        torch.testing.assert_close(amax.double(), g_exact.abs().max(), rtol=1e-5, atol=0)
        limit = E4M3_MAX * scale.double()
        want = g_exact.clamp(-limit, limit)
        got = g8.double() * scale.double()
        # (the true amax, rounded to fp32, may lie a rounding below the exact one)
        assert (g_exact.abs() > limit * (1 + 1e-6)).any() == (history < 1), "values past the scale's range, or none"

        def near(w):
            return (got - w).abs() <= (2.0 ** -4 + 1e-3) * w.abs() + 2.0 ** -10 * scale.double()

        assert (near(want) | near(want / 2)).all() if interpreter else near(want).all()
        assert near(want).double().mean() > 0.9
        rest = [others[0]] + [g for g, t in zip(others[1:], inputs[4:]) if t is not None]
        for i, (a, want) in enumerate(zip(rest, exact[4:], strict=True)):  # as check's, but for qkv's (above)
            assert a.dtype == (torch.float32 if i == 0 else dtype) and a.shape == want.shape, i
            if i == 0:
                bound = sum(g.double().abs().sum() * t.double().abs().max()
                            for g, t in zip(grads[2:], inputs[:1] + inputs[4:]) if t is not None)
                assert (a.double() - want).abs().max() < 1e-5 * bound, (a, want)
            else:
                torch.testing.assert_close(a.double(), want, rtol=rtol, atol=atol * want.abs().max().item())


# --- GPU ----------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("B, T, H, d", [(1, 49152, 6, 128), (2, 37, 3, 64)])
def test_kernels_on_gpu(B, T, H, d):
    """The record's micro-batch, and 222 rows: 13 programs of 16 and a partial one, another head count and width."""
    check(B, T, H, d, torch.bfloat16, "cuda", rtol=2.0 ** -8, atol=1e-5)


@gpu
@pytest.mark.parametrize("history", [1.0, 0.5])
@pytest.mark.parametrize("B, T, H, d", [(1, 49152, 6, 128), (2, 37, 3, 64)])
def test_fp8_kernel_on_gpu(B, T, H, d, history):
    """The record's micro-batch, and 222 rows: 13 programs of 16 and a partial one, another head count and width."""
    check_fp8(B, T, H, d, torch.bfloat16, "cuda", history, rtol=2.0 ** -8, atol=1e-5)


@gpu
def test_compiled_launches_only_the_kernels():
    """Under torch.compile the forward and backward launch their kernel, the reduction of the weights' partial sums
    (one kernel or a split pair) and nothing else: no copy of an operand that inductor believes written, which
    would be a pointwise kernel. The results equal eager's."""
    from torch._inductor.utils import run_and_get_code

    inputs, grads = problem(1, 4096, 6, 128, torch.bfloat16, "cuda", v_first=False, ve=True)
    got, codes = run_and_get_code(run, torch.compile(QKVPrep.apply, dynamic=False), inputs, grads)
    launched = [re.sub(r"(_\d+)+$", "", name) for name in re.findall(r"(\w+)\.run\(", "\n".join(codes))]
    ours = sorted(name for name in launched if name in ("_qkv_forward_kernel", "_qkv_backward_kernel"))
    others = [name for name in launched if name not in ours]
    assert ours == ["_qkv_backward_kernel", "_qkv_forward_kernel"] and 1 <= len(others) <= 2, launched
    assert all(re.fullmatch(r"triton_(per|red)_fused\w*_sum\w*", name) for name in others), launched
    for a, b in zip(got, run(QKVPrep.apply, inputs, grads), strict=True):
        torch.testing.assert_close(a, b)


# --- CPU, Triton interpreter --------------------------------------------------------------------------------------
test_kernels_in_the_triton_interpreter = interpreter_parent(__file__, 3)


@interpreted
def test_interpreted_kernels():
    """In fp32, 60 rows: 3 programs of 16 and a partial one."""
    check(2, 10, 3, 16, torch.float32, "cpu", rtol=1e-5, atol=1e-6)


@interpreted
def test_interpreted_fp8_kernel():
    """In fp32, 222 rows: 13 programs of 16 and a partial one; history 1/2 saturates."""
    for history in (1.0, 0.5):
        check_fp8(2, 37, 3, 16, torch.float32, "cpu", history, rtol=1e-5, atol=1e-6, interpreter=True)


@interpreted
def test_interpreted_transposed_copy():
    """The transposing copy (model/fast/transpose_kernels.py: FP8QKV's, ReLU2MLP's and the head's) of an e4m3 tensor is
    its transpose, bit for bit, at a size off both tiles: 100 rows = 64 + 36, 300 columns = 2 x 128 + 44."""
    t = (torch.randn(100, 300, generator=torch.Generator().manual_seed(0)) * 100).to(torch.float8_e4m3fn)
    got = transpose_kernels.transposed(t)
    assert got.shape == (300, 100) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8).t())


@pytest.mark.parametrize("history", [1.0, 0.5])
def test_fp8_gradient_on_torch_ops(history):
    """The kernel's reference (FP8QKV's path off CUDA) passes the kernel's check, in bf16."""
    check_fp8(2, 37, 3, 16, torch.bfloat16, "cpu", history, rtol=2.0 ** -8, atol=1e-5, fn=qkv_prep_grad_fp8)


def test_kernels_take_power_of_two_halves_only():
    """Attention falls back to the torch ops for other head widths (GPTConfig allows any multiple of 4)."""
    assert [d for d in range(4, 260, 4) if qkv_kernels.supports(d)] == [4, 8, 16, 32, 64, 128, 256]
