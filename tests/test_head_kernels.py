"""model/fast/head_kernels.py: the Triton kernels of the head loss against the torch ops of model/fast/head.py (same
names).

On a GPU (`pytest -m gpu`) at the training's sizes. On the CPU through the Triton interpreter where triton is
installed: TRITON_INTERPRET=1 must be set before triton decorates the kernels (when model.fast.head imports them),
so those tests run in a child pytest (`test_kernels_in_the_triton_interpreter`); `TRITON_INTERPRET=1 pytest
tests/test_head_kernels.py` runs them directly."""
import re

import pytest
import torch
import torch.nn.functional as F

from helpers import interpreted, interpreter_parent
from model.gpt import IGNORE_INDEX

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast import head
from model.fast.head import GRAD_FP8_SCALE

SOFTCAP = 15.0
# The kernels' tanh (PTX tanh.approx.f32, relative error <= 1.1e-5 measured: model/fast/head_kernels.py) moves each
# capped logit by up to 15 * 1.1e-5 = 1.7e-4, so each probability by up to 2 * 1.7e-4 relative (its logit and the
# lse), and tanh' = 1 - tanh^2 by up to 1.3e-5 absolute (measured), plus fp32 rounding; the unit gradient is at most 1
GRAD_RTOL_FP32, GRAD_ATOL = 4e-4, 3e-5
# e5m2 keeps 2 mantissa bits: round-to-nearest is within 2^-3 relative, and within half the smallest subnormal
# (2^-16) of the scale below that
E5M2_RTOL, E5M2_ATOL_OF_SCALE = 2.0 ** -3, 2.0 ** -17

gpu = pytest.mark.gpu


def problem(n, v, dtype, device, seed=0):
    """Raw logits with a trained model's spread (std 3, a few peaks near the cap) and one row of extremes (up to
    1e4, past where exp(2 l / c) overflows fp32), targets with ignored positions and one on an extreme."""
    g = torch.Generator(device).manual_seed(seed)
    logits = 3.0 * torch.randn(n, v, generator=g, device=device)
    logits[torch.randint(0, n, (n,), generator=g, device=device),
           torch.randint(0, v, (n,), generator=g, device=device)] = 20.0
    logits[0, :9] = torch.tensor([1e4, -1e4, 700.0, -700.0, 3e4, -3e4, 60.0, -60.0, 0.0])
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    targets[torch.randperm(n, generator=g, device=device)[: n // 20]] = IGNORE_INDEX
    targets[0] = 1  # the target at -1e4
    return logits.to(dtype), targets


def reference(logits, targets):
    """lse, loss and the unit gradient by model.fast.head's torch ops in fp64."""
    lse, loss = head.lse_and_loss(logits.double(), targets, SOFTCAP)
    return lse, loss, head.unit_grad(logits.double(), lse, targets, SOFTCAP)


def cosine(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def check_forward(logits, targets):
    lse, loss = head.head_kernels.lse_and_loss(logits, targets, SOFTCAP)
    want_lse, want_loss, _ = reference(logits, targets)
    assert lse.dtype == loss.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-4, atol=1e-4)
    assert (loss[targets == IGNORE_INDEX] == 0).all()


def check_unit_grad(logits, targets, rtol):
    """The loss is lse_and_loss's, bit for bit; the unit gradient is within rtol of each fp64 value, plus 3e-5
    absolute for tanh' (above) and fp32 rounding (|unit| <= 1); rows of ignored targets are 0."""
    loss, u = head.head_kernels.loss_and_unit_grad(logits, targets, SOFTCAP)
    assert torch.equal(loss, head.head_kernels.lse_and_loss(logits, targets, SOFTCAP)[1])
    assert u.dtype == logits.dtype and u.shape == logits.shape
    torch.testing.assert_close(u.double(), reference(logits, targets)[2], rtol=rtol, atol=GRAD_ATOL)
    assert not u[targets == IGNORE_INDEX].any()


def fp8_unit(logits, targets):
    """(the kernel's e5m2 unit gradient, dequantised; the fp64 one), after checking the loss and the layouts."""
    loss, u8, u8t = head.head_kernels.loss_and_unit_grad_fp8(logits, targets, SOFTCAP, GRAD_FP8_SCALE)
    assert torch.equal(loss, head.head_kernels.lse_and_loss(logits, targets, SOFTCAP)[1])
    assert u8.dtype == u8t.dtype == torch.float8_e5m2 and u8t.shape == u8.shape[::-1] and u8t.is_contiguous()
    assert torch.equal(u8.view(torch.uint8).t(), u8t.view(torch.uint8))  # one value, two layouts
    return u8.double() / GRAD_FP8_SCALE, reference(logits, targets)[2]


# --- GPU ------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, v", [(8192, 50304), (333, 1001)])
def test_lse_and_loss_on_gpu(n, v, dtype):
    """The record's vocabulary (and a size off every tile) against fp64 torch ops: lse and loss to 1e-4."""
    check_forward(*problem(n, v, dtype, "cuda"))


@gpu
@pytest.mark.parametrize("dtype, rtol", [(torch.bfloat16, 2.0 ** -8), (torch.float32, GRAD_RTOL_FP32)])
@pytest.mark.parametrize("n, v", [(8192, 50304), (333, 1001)])
def test_loss_and_unit_grad_on_gpu(n, v, dtype, rtol):
    """The unit gradient in the logits' dtype against fp64: within one bf16 rounding (2^-9), or tanh.approx's
    error."""
    check_unit_grad(*problem(n, v, dtype, "cuda"), rtol=rtol)


@gpu
@pytest.mark.parametrize("n, v", [(8192, 50304), (333, 1001)])
def test_loss_and_unit_grad_fp8_on_gpu(n, v):
    """Both e5m2 layouts hold the same bits; dequantised, each value is within e5m2's rounding of the fp64 unit
    gradient, and the whole is as aligned with it as torch's own e5m2 cast of the fp64 gradient (~0.998: e5m2's
    2-bit mantissa alone keeps the cosine below 0.999)."""
    logits, targets = problem(n, v, torch.bfloat16, "cuda")
    got, want = fp8_unit(logits, targets)
    torch.testing.assert_close(got, want, rtol=E5M2_RTOL + 1e-3, atol=E5M2_ATOL_OF_SCALE / GRAD_FP8_SCALE)
    torch_e5m2 = (want * GRAD_FP8_SCALE).float().to(torch.float8_e5m2).double() / GRAD_FP8_SCALE
    assert cosine(got, want) > cosine(torch_e5m2, want) - 1e-4


@gpu
def test_kernels_index_past_2_31_at_the_training_size():
    """49,152 x 50,304 logits have more than 2^31 elements: the last rows (and the transposed layout's last
    columns) match the kernels run on those rows alone."""
    logits, targets = problem(49152, 50304, torch.bfloat16, "cuda")
    kernels = head.head_kernels
    lse, loss = kernels.lse_and_loss(logits, targets, SOFTCAP)
    u = kernels.loss_and_unit_grad(logits, targets, SOFTCAP)[1]
    _, u8, u8t = kernels.loss_and_unit_grad_fp8(logits, targets, SOFTCAP, GRAD_FP8_SCALE)
    tail = slice(-64, None)
    tail_args = logits[tail].contiguous(), targets[tail]
    tail_lse, tail_loss = kernels.lse_and_loss(*tail_args, SOFTCAP)
    assert torch.equal(lse[tail], tail_lse) and torch.equal(loss[tail], tail_loss)
    assert torch.equal(u[tail], kernels.loss_and_unit_grad(*tail_args, SOFTCAP)[1])
    _, tail_u8, tail_u8t = kernels.loss_and_unit_grad_fp8(*tail_args, SOFTCAP, GRAD_FP8_SCALE)
    assert torch.equal(u8[tail].view(torch.uint8), tail_u8.view(torch.uint8))
    assert torch.equal(u8t[:, tail].view(torch.uint8), tail_u8t.view(torch.uint8))


@gpu
def test_compiled_ops_launch_only_the_kernels():
    """Under torch.compile the three ops launch their own kernels and nothing else. Inductor copies every input it
    believes a user kernel writes; a Triton helper function taking the pointers makes it believe that of the
    logits (a copy of them beside each backward), so the forward kernel passes its helpers loaded values only."""
    from torch._inductor.utils import run_and_get_code

    logits, targets = problem(8192, 50304, torch.bfloat16, "cuda")
    kernels = head.head_kernels

    def ops(logits, targets):
        return (kernels.lse_and_loss(logits, targets, SOFTCAP), kernels.loss_and_unit_grad(logits, targets, SOFTCAP),
                kernels.loss_and_unit_grad_fp8(logits, targets, SOFTCAP, GRAD_FP8_SCALE))

    _, codes = run_and_get_code(torch.compile(ops, dynamic=False), logits, targets)
    launched = re.findall(r"(\w+)\.run\(", "\n".join(codes))
    assert sorted(re.sub(r"(_\d+)+$", "", name) for name in launched) == [
        "_forward_kernel", "_forward_kernel", "_forward_kernel", "_transpose_kernel"], launched


# --- CPU, Triton interpreter ------------------------------------------------------------------------------------
test_kernels_in_the_triton_interpreter = interpreter_parent(__file__, 3)


# Sizes off every tile: 2,500 columns = 2,048 + 452 (forward); the transpose's tiles: 100 rows = 64 + 36, 2,500
# columns = 19 x 128 + 68.
@interpreted
def test_interpreted_lse_and_loss():
    check_forward(*problem(100, 2500, torch.bfloat16, "cpu"))


@interpreted
def test_interpreted_loss_and_unit_grad():
    """The interpreter rounds fp32 -> bf16 by truncation (the GPU to nearest): within 2^-7, not 2^-8."""
    check_unit_grad(*problem(100, 2500, torch.bfloat16, "cpu"), rtol=2.0 ** -7)


@interpreted
def test_interpreted_loss_and_unit_grad_fp8():
    """Layouts and tile edges. triton 3.6's interpreter casts fp32 -> e5m2 with a carry bug: a mantissa that
    rounds up past 1.75 wraps to 1.0, halving the value (the GPU rounds to nearest). So each value is within
    e5m2's rounding of the reference, or of half of it."""
    got, want = fp8_unit(*problem(100, 2500, torch.bfloat16, "cpu"))
    atol = E5M2_ATOL_OF_SCALE / GRAD_FP8_SCALE

    def near(a):
        return torch.isclose(got, a, rtol=E5M2_RTOL + 1e-3, atol=atol)

    assert (near(want) | near(want / 2)).all()
    assert near(want).float().mean() > 0.8
