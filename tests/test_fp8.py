"""The blocks' FP8 products (model/fast/fp8.py; ReLU2MLP's fp8 paths in model/fast/mlp.py and FP8QKV in
model/fast/blocks.py): the e4m3 copies and their scales, the products against fp32 torch ops on the same FP8 values,
and the backward against bf16 autograd's. The MLP's FP8 kernels run on a Hopper GPU only (`pytest -m gpu`);
torch._scaled_mm runs on the CPU too."""
import copy

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from helpers import output_and_grads as grads
from model.config import GPTConfig
from model.gpt import prepare_qkv, rotary_tables
from runtime.dist import Runtime, agree_on_max

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast import blocks, mlp, mlp_kernels
from model.fast.fp8 import (E4M3_MAX, delayed_scale, grad_operands, normed_fp8_linear,
                            normed_operands, normed_scale, relu2_scale, scale_of, to_e4m3)
from model.fast.gpt import FastGPT

gpu = pytest.mark.gpu
hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                            reason="the Gluon kernels need a Hopper GPU (compute capability 9)")
E4M3_RTOL = 2.0 ** -4  # half a unit in the last place of e4m3's 3 mantissa bits


def fp8_mlp(x, w1, w2, r):
    return mlp.ReLU2MLP.apply(x, w1, w2, r, True)


def bf16_mlp(x, w1, w2, r):
    return mlp.ReLU2MLP.apply(x, w1, w2, r, False)


def normed(m, k, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    return F.rms_norm(torch.randn(m, k, generator=g, device=device), (k,))


def test_the_normed_bound_maps_to_e4m3_max_and_nothing_overflows():
    """A row with all its mass in one channel, sqrt(D) (RMS 1), becomes exactly E4M3_MAX; other normed values keep
    e4m3's relative precision (those in its normal range, above 2^-6 after scaling)."""
    d = 768
    x = torch.zeros(2, d)
    x[0, 5] = -(d ** 0.5)
    x[1] = normed(1, d)
    scale = normed_scale(x)
    x8 = to_e4m3(x, scale)
    assert x8[0, 5].float().item() == -E4M3_MAX and torch.isfinite(x8.float()).all()
    torch.testing.assert_close(x8[0].float() * scale, x[0], rtol=1e-6, atol=0)  # the bound itself, not clamped
    back, row = x8[1].float() * scale, x[1]
    in_range = row.abs() / scale >= 2.0 ** -6
    assert in_range.float().mean() > 0.99
    torch.testing.assert_close(back[in_range], row[in_range], rtol=E4M3_RTOL, atol=0)
    assert (back - row).abs().max() > 1e-3  # it did round to 3 mantissa bits


def test_a_zero_weight_gets_scale_one():
    """A zero-initialised weight (the output projections') must not divide by zero."""
    assert scale_of(torch.zeros(4, 4)).item() == 1.0
    assert scale_of(torch.tensor([[0.5, -896.0]])).item() == 2.0


def test_the_hidden_bound_holds_for_the_worst_aligned_row():
    """relu2_scale bounds h from the weight alone: a normed row along W1's longest column gives the largest p that
    any normed row can, and its h must land inside e4m3's range, one margin (1 + 2^-3)^2 below E4M3_MAX (within
    e4m3's and bf16's roundings); other rows land lower. A zero weight gets scale 1, not a division by zero."""
    d, f = 64, 256
    g = torch.Generator().manual_seed(3)
    w = torch.randn(d, f, generator=g) * d ** -0.5
    w[:, 7] *= 3  # the longest column, by far
    x = torch.cat([w[:, 7:8].t() / w[:, 7].square().mean().sqrt(), normed(31, d)])  # RMS 1 rows
    x8, w8, scale = normed_operands(x.bfloat16(), w.bfloat16())
    h_scale = relu2_scale(w8, scale)
    h, h8 = mlp.relu2_matmul_fp8(x8, w8, scale, 1 / h_scale)
    top = h8.float().max(1).values
    assert torch.isfinite(h8.float()).all()
    torch.testing.assert_close(top[0], torch.tensor(E4M3_MAX * (1 + 2 ** -3) ** -2), rtol=2.0 ** -3, atol=0)
    assert (top[1:] < top[0] / 4).all()
    torch.testing.assert_close(h8.float() * h_scale, h.float(), rtol=2.0 ** -4, atol=2.0 ** -10 * h_scale.item())
    zero8 = to_e4m3(torch.zeros(f, d), scale_of(torch.zeros(f, d)))
    assert relu2_scale(zero8, scale).item() == 1.0


def test_normed_fp8_linear_is_the_product_of_the_e4m3_copies():
    """torch._scaled_mm of the two e4m3 copies, equal to fp32 ops on the same FP8 values, and within a few e4m3
    roundings of the exact product; a copy of x passed in (MixNorm's) is what the product reads."""
    x = normed(2 * 37, 64).view(2, 37, 64)
    w = torch.randn(96, 64) * 0.05
    out, x8, x_scale = normed_fp8_linear(x, w, None)
    w_scale = scale_of(w)
    assert torch.equal(x8, to_e4m3(x, normed_scale(x)).view(-1, 64)) and torch.equal(x_scale, normed_scale(x))
    on_fp8 = (to_e4m3(x, x_scale).float() * x_scale) @ (to_e4m3(w, w_scale).float() * w_scale).t()
    torch.testing.assert_close(out, on_fp8, rtol=1e-5, atol=1e-5)
    exact = F.linear(x.double(), w.double())
    err = (out.double() - exact).abs().max() / exact.abs().max()
    assert 1e-3 < err < 0.1, err
    assert torch.equal(normed_fp8_linear(x, w, to_e4m3(x, x_scale))[0], out)
    other = normed(2 * 37, 64, seed=1).view(2, 37, 64)
    assert torch.equal(normed_fp8_linear(x, w, to_e4m3(other, x_scale))[0], normed_fp8_linear(other, w, None)[0])


def test_fp8_mlp_on_torch_ops():
    """ReLU2MLP with fp8 off the kernels: h and its e4m3 copy from relu2_matmul_fp8 of the e4m3 copies of x and W1,
    the output r + h8 @ W2^T on e4m3 copies (matmul_add_fp8), the backward the bf16 one at h (grad W2 = grad_y^T h
    exactly); everything within FP8's error of the bf16 MLP."""
    m, d, f = 64, 32, 128
    g = torch.Generator().manual_seed(1)
    x = normed(m, d).bfloat16()
    w1, w2 = [(torch.randn(d, f, generator=g) * d ** -0.5).bfloat16() for _ in range(2)]
    r, grad_y = [torch.randn(m, d, generator=g).bfloat16() for _ in range(2)]

    got = grads(fp8_mlp, x, w1, w2, r, grad_y)
    x_scale, w_scale = normed_scale(x), scale_of(w1)
    x8, w8 = to_e4m3(x, x_scale), to_e4m3(w1.t(), w_scale).contiguous()
    h_scale = relu2_scale(w8, x_scale * w_scale)
    h, h8 = mlp.relu2_matmul_fp8(x8, w8, x_scale * w_scale, 1 / h_scale)
    exact_h = F.relu((x8.double() @ w8.double().t()) * (x_scale * w_scale).double()).square()
    torch.testing.assert_close(h.double(), exact_h, rtol=2.0 ** -8, atol=0)  # one bf16 rounding
    torch.testing.assert_close(h8.double() * h_scale.double(), exact_h, rtol=2.0 ** -4,  # one e4m3 rounding
                               atol=2.0 ** -10 * h_scale.item())  # (subnormals: half their spacing)
    w2_scale = scale_of(w2)
    want_y = r.double() + (h8.double() @ to_e4m3(w2, w2_scale).double().t()) * (h_scale * w2_scale).double()
    torch.testing.assert_close(got[0].double(), want_y, rtol=2.0 ** -8, atol=1e-6)  # one bf16 rounding of the sum
    torch.testing.assert_close(got[3], (grad_y.t() @ h).to(torch.bfloat16), rtol=0, atol=0)
    want = grads(bf16_mlp, x, w1, w2, r, grad_y)
    for a, b in zip(got, want, strict=True):
        scale = b.float().abs().max()
        assert (a.float() - b.float()).abs().max() < 0.1 * scale
    assert (got[3].float() - want[3].float()).abs().max() > 0  # h differs: the first product was FP8


def fp8_backward_operands(m, d, f, device="cpu"):
    g = torch.Generator(device).manual_seed(2)
    x = normed(m, d, device).bfloat16()
    w1, w2 = [(torch.randn(d, f, generator=g, device=device) * d ** -0.5).bfloat16() for _ in range(2)]
    r, grad_y = [torch.randn(m, d, generator=g, device=device).bfloat16() for _ in range(2)]
    return x, w1, w2, r, grad_y


def decoded(t8, scale):
    return t8.double() * scale.double()


@pytest.mark.parametrize("history", [1.0, 0.5])
def test_fp8_backward_mlp_on_torch_ops(history):
    """ReLU2MLP with grad_amax off the kernels: the pre-activation's gradient is the product of the e4m3 copies of
    grad_y and W2 (grad_operands), copied at the delayed scale of grad_amax's value before the call (the true amax,
    or half of it: the largest values saturate), and grad_amax then holds this gradient's amax; each of the other
    three FP8 products equals fp64's product of the e4m3 copies it reads, up to one rounding of its output; the
    forward and the residual's gradient are the FP8 forward's. With the true amax as history, all four gradients
    within FP8's error of the bf16 MLP's."""
    x, w1, w2, r, grad_y = fp8_backward_operands(64, 32, 128)
    x_scale, w_scale = normed_scale(x), scale_of(w1)
    x8, w8 = to_e4m3(x, x_scale), to_e4m3(w1.t(), w_scale).contiguous()
    h_scale = relu2_scale(w8, x_scale * w_scale)
    h, h8 = mlp.relu2_matmul_fp8(x8, w8, x_scale * w_scale, 1 / h_scale)
    gy8, w2_8, gy_scale, w2_scale = grad_operands(grad_y, w2)
    grad_pre = mlp.relu2_matmul_grad(gy8.float(), w2_8.float().t() * (gy_scale * w2_scale), h.float())
    amax = (history * grad_pre.abs().amax()).reshape(())
    g_scale = delayed_scale(amax)

    got = grads(lambda *a: mlp.ReLU2MLP.apply(*a, True, amax), x, w1, w2, r, grad_y)
    torch.testing.assert_close(amax, grad_pre.abs().amax(), rtol=0, atol=0)
    g8 = to_e4m3(grad_pre, g_scale)
    assert (grad_pre.abs() > E4M3_MAX * g_scale).any() == (history < 1)  # values past the scale's range or none
    fc_scale = scale_of(w1)
    want = [r.double() + decoded(h8, h_scale) @ decoded(to_e4m3(w2, w2_scale), w2_scale).t(),
            decoded(g8, g_scale) @ decoded(to_e4m3(w1, fc_scale), fc_scale).t(),
            decoded(x8, x_scale).t() @ decoded(g8, g_scale),
            decoded(gy8, gy_scale).t() @ decoded(h8, h_scale)]
    for a, b in zip(got[:4], want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2.0 ** -8, atol=1e-6 * b.abs().max().item())
    assert torch.equal(got[4], grad_y)
    if history == 1:  # (at half, the saturated values' gradients are clipped: W1's off by 41% of its largest)
        bf16 = grads(bf16_mlp, x, w1, w2, r, grad_y)
        for a, b in zip(got, bf16, strict=True):
            assert (a.float() - b.float()).abs().max() < 0.1 * b.float().abs().max()


def test_a_site_without_history_gets_scale_one():
    """grad_amax 0 (a new run, or a resumed one: the buffer is not saved) copies the first gradient at scale 1 and
    records its amax for the next call."""
    x, w1, w2, r, grad_y = fp8_backward_operands(64, 32, 128)
    amax = torch.zeros(())
    h = mlp.relu2_matmul_fp8_t(*normed_operands(x, w1), torch.ones(()))[0]
    gy8, w2_8, gy_scale, w2_scale = grad_operands(grad_y, w2)
    g8, g8t, scale = mlp.relu2_matmul_grad_fp8(gy8, w2_8, gy_scale * w2_scale, h, amax)
    assert scale.item() == 1.0 and torch.equal(g8t.float(), g8.float().t())
    want = mlp.relu2_matmul_grad(gy8.float(), w2_8.float().t() * (gy_scale * w2_scale), h.float())
    assert amax.item() == want.abs().max().item() > 0


def qkv_problem(B, T, H, d, D, seed):
    """FP8QKV's inputs on the CPU: normed bf16 rows x (B, T, D), the fused weight (3 H d, D), the rotary tables, value
    weights, a value embedding, and the upstream gradients of q, k, v."""
    g = torch.Generator().manual_seed(seed)
    x = normed(B * T, D).bfloat16().view(B, T, D)
    w = (torch.randn(3 * H * d, D, generator=g) * D ** -0.5).bfloat16()
    cos, sin = rotary_tables(T, d, 1024.0, torch.device("cpu"))
    lambdas, ve = torch.tensor([0.7, -0.4, 1.3]), torch.randn(B, T, H * d, generator=g).bfloat16()
    upstream = [torch.randn(B, T, H, d, generator=g).bfloat16() for _ in range(3)]
    return x, w, cos, sin, lambdas, ve, upstream


@pytest.mark.parametrize("history", [1.0, 0.5])
def test_fp8_backward_qkv_on_torch_ops(history):
    """FP8QKV off the kernels: q, k, v are prepare_qkv's of the FP8 product (normed_fp8_linear); x's gradient equals
    fp64's product of the e4m3 copies it reads, up to one rounding of its output: the output gradient's at the delayed
    scale of grad_amax's value before the call (qkv_prep_grad_fp8, which tests/test_qkv.py checks) and w's; grad_amax
    then holds this gradient's amax; w's gradient is likewise the product of that copy and x's e4m3 copy at its fixed
    scale; the value weights' and embedding's gradients are prepare_qkv's at the FP8 product. With the true amax as
    history, the gradients of x and w within FP8's error of the bf16 path's (F.linear, then prepare_qkv)."""
    B, T, H, d, D = 2, 16, 2, 16, 32
    x, w, cos, sin, lambdas, ve, upstream = qkv_problem(B, T, H, d, D, seed=3)

    qkv = normed_fp8_linear(x, w, None)[0].view(B, T, 3 * H, d)
    g_exact = qkv_grad(qkv, cos, sin, lambdas, ve, upstream)
    amax = (history * g_exact.abs().amax()).float().reshape(())
    g8, g_scale, want_lambdas, _, want_ve = blocks.qkv_prep_grad_fp8(*upstream, qkv, cos, sin, lambdas, None, ve,
                                                                     amax.clone())
    leaves = [t.detach().requires_grad_() for t in (x, w, lambdas, ve)]
    outs = blocks.FP8QKV.apply(leaves[0], leaves[1], None, cos, sin, leaves[2], None, leaves[3], amax, H)
    torch.autograd.backward(outs, upstream)
    got_x, got_w, got_lambdas, got_ve = (t.grad for t in leaves)

    for a, b in zip(outs, prepare_qkv(qkv, cos, sin, lambdas, None, ve), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(amax.double(), g_exact.abs().amax(), rtol=1e-6, atol=0)  # fp32 autograd's
    assert (g_exact.abs() > E4M3_MAX * g_scale * (1 + 1e-6)).any() == (history < 1)  # values past the range or none
    w_scale = scale_of(w)
    want_x = decoded(g8, g_scale) @ decoded(to_e4m3(w, w_scale), w_scale)
    assert got_x.dtype == torch.bfloat16
    torch.testing.assert_close(got_x.flatten(0, 1).double(), want_x, rtol=2.0 ** -8,
                               atol=1e-6 * want_x.abs().max().item())
    x_scale = normed_scale(x)
    want_w = decoded(g8, g_scale).t() @ decoded(to_e4m3(x, x_scale), x_scale).flatten(0, 1)
    assert got_w.dtype == torch.bfloat16
    torch.testing.assert_close(got_w.double(), want_w, rtol=2.0 ** -8, atol=1e-6 * want_w.abs().max().item())
    assert torch.equal(got_lambdas, want_lambdas) and torch.equal(got_ve, want_ve)
    if history == 1:
        leaves = [t.detach().requires_grad_() for t in (x, w)]
        bf16_qkv = F.linear(leaves[0], leaves[1]).view(B, T, 3 * H, d)
        torch.autograd.backward(prepare_qkv(bf16_qkv, cos, sin, lambdas, None, ve), upstream)
        for a, b in ((got_x, leaves[0].grad), (got_w, leaves[1].grad)):
            assert (a.float() - b.float()).abs().max() < 0.1 * b.float().abs().max()


@gpu
@hopper
def test_compiled_fp8_qkv_on_gpu(monkeypatch):
    """At a block's size on the GPU: the compiled FP8QKV gives eager's outputs, gradients and grad_amax; it calls the
    kernels that write the copies (QKVPrep's backward and two transposing copies, x's in the forward and the
    gradient's in the backward) and no bf16 product; its outputs and gradients match the torch ops' path (FP8QKV off
    the kernels, on the same GPU) within the rounding of a few e4m3 values (the two compute the gradient's fp32
    values in a different order). A GPU test: on the CPU torch._scaled_mm is far too slow at this size."""
    import re

    from torch._inductor.utils import run_and_get_code

    B, T, H, d, D = 1, 4096, 6, 128, 768
    x, w, cos, sin, lambdas, ve, upstream = qkv_problem(B, T, H, d, D, seed=5)

    def fp8_qkv(amax, cos, sin):
        return lambda x, w, lambdas, ve: blocks.FP8QKV.apply(x, w, None, cos, sin, lambdas, None, ve, amax, H)

    def outputs_and_grads(fn, *inputs, upstream):
        leaves = [t.detach().requires_grad_() for t in inputs]
        outs = fn(*leaves)
        torch.autograd.backward(outs, upstream)
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    on_gpu = [t.cuda() for t in (x, w, lambdas, ve)]
    up_gpu = [u.cuda() for u in upstream]
    amax = torch.zeros((), device="cuda")
    tables = cos.cuda(), sin.cuda()
    outputs_and_grads(fp8_qkv(amax, *tables), *on_gpu, upstream=up_gpu)  # amax's history
    history = amax.clone()
    want = outputs_and_grads(fp8_qkv(amax, *tables), *on_gpu, upstream=up_gpu)
    assert torch.equal(amax, history) and history > 0  # the same gradient again, the same amax
    got, codes = run_and_get_code(outputs_and_grads, torch.compile(fp8_qkv(amax, *tables), dynamic=False), *on_gpu,
                                  upstream=up_gpu)
    code = "\n".join(codes)
    launched = [re.sub(r"(_\d+)+$", "", name) for name in re.findall(r"(\w+)\.run\(", code)]
    ours = ("_qkv_forward_kernel", "_qkv_backward_kernel", "_transpose_kernel")
    assert sorted(name for name in launched if name in ours) == [
        "_qkv_backward_kernel", "_qkv_forward_kernel", "_transpose_kernel", "_transpose_kernel"], launched
    assert not re.search(r"extern_kernels\.(mm|addmm|bmm)\(", code)  # a bf16 product would be one of these
    assert torch.equal(amax, history)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)

    monkeypatch.setattr(blocks, "on_qkv_kernels", lambda x, head_dim: False)
    on_torch_ops = outputs_and_grads(fp8_qkv(history.clone(), *tables), *on_gpu, upstream=up_gpu)
    for a, b in zip(want, on_torch_ops, strict=True):
        a, b = a.double(), b.double()
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def qkv_grad(qkv, cos, sin, lambdas, ve, upstream):
    """prepare_qkv's gradient for qkv (B T, 3 H d) in fp64."""
    leaf = qkv.double().requires_grad_()
    outs = prepare_qkv(leaf, cos.double(), sin.double(), lambdas.double(), None, ve.double())
    torch.autograd.backward(outs, [u.double() for u in upstream])
    return leaf.grad.flatten(0, 1).flatten(1)


def small_model(dim=64):
    return FastGPT(GPTConfig(num_layers=2, model_dim=dim, num_heads=2, head_dim=dim // 2,
                             num_value_embeds=1))


def fp8_parts(model):
    return [part.fp8 for b in model.blocks for part in (b.attn, b.mlp) if part is not None]


def amaxes(model) -> list[float]:
    """grad_amax of each block's attention, then its MLP's."""
    return [part.grad_amax.item() for b in model.blocks for part in (b.attn, b.mlp)]


def test_the_gradient_history_is_saved_with_the_weights():
    """A resumed run continues with the FP8 backward's scales it had: the grad_amax of each attention and MLP is in
    their state and comes back with it, and the warm-up's restore of the initial state brings back its 0. A state
    without it (a checkpoint written before it was saved) loads with no history."""
    model = small_model()
    initial = copy.deepcopy(model.state_dict())
    for i, block in enumerate(model.blocks):
        block.attn.grad_amax.fill_(1.0 + i)
        block.mlp.grad_amax.fill_(3.0 + i)
    saved = copy.deepcopy(model.state_dict())
    assert [saved[f"blocks.{i}.{part}.grad_amax"].item() for i in range(2) for part in ("attn", "mlp")] == \
        [1.0, 3.0, 2.0, 4.0]
    model.load_state_dict(initial)
    assert amaxes(model) == [0.0] * 4
    model.load_state_dict(saved)
    assert amaxes(model) == [1.0, 3.0, 2.0, 4.0]
    older = {k: v for k, v in initial.items() if not k.endswith("grad_amax")}
    model.load_state_dict(older)  # strict: no missing key
    assert amaxes(model) == [0.0] * 4


def histories(rank: int) -> list[float]:
    """Each rank's grad_amax per block (attention, MLP) after agree_on_max of the model's scale_histories: block 0's
    attention and MLP run their backward in FP8, block 1's not."""
    model = small_model()
    for part in (model.blocks[0].attn, model.blocks[0].mlp):
        part.fp8 = True
    for block, amax in zip(model.blocks, [[[2.0, 7.0], [6.0, 8.0]], [[5.0, 1.0], [3.0, 4.0]]][rank]):
        block.attn.grad_amax.fill_(amax[0])
        block.mlp.grad_amax.fill_(amax[1])
    world_size = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
    agree_on_max(model.scale_histories(), Runtime(rank, world_size, torch.device("cpu")))
    return amaxes(model)


def scales_rank_main(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.save(histories(rank), f"{out_dir}/rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def test_ranks_agree_on_the_gradient_history(tmp_path):
    """With two gloo ranks, every attention and MLP whose backward runs in FP8 takes the larger of the two ranks'
    amaxes, so the next step's scales and a checkpoint's (rank 0's) history are every rank's; the others keep their
    own. One process changes nothing."""
    mp.start_processes(scales_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")  # as tests/test_optim_dist.py
    assert torch.load(tmp_path / "rank0.pt") == [5.0, 7.0, 6.0, 8.0]
    assert torch.load(tmp_path / "rank1.pt") == [5.0, 7.0, 3.0, 4.0]
    assert histories(0) == [2.0, 7.0, 6.0, 8.0]


def test_fp8_stays_off_where_its_kernels_cannot_run():
    """On the CPU (and any GPU but Hopper) --fp8 leaves every block in bf16."""
    model = small_model()
    model.configure(torch.device("cpu"), fp8=True)
    assert fp8_parts(model) == [False] * 4


@gpu
@hopper
def test_fp8_is_on_for_every_block_on_hopper_where_the_widths_allow():
    """On as asked (forward and backward together), and off again; and off for a width whose FP8 rows would not be
    16-byte aligned (8 channels)."""
    model = small_model()
    model.configure(torch.device("cuda"), fp8=True)
    assert fp8_parts(model) == [True] * 4 and len(model.scale_histories()) == 4
    model.configure(torch.device("cuda"), fp8=False)
    assert fp8_parts(model) == [False] * 4
    narrow = small_model(dim=8)
    narrow.configure(torch.device("cuda"), fp8=True)
    assert fp8_parts(narrow) == [False] * 4


@gpu
@hopper
@pytest.mark.parametrize("m, k, n", [(49152, 768, 3072), (300, 80, 528), (4100, 80, 1040)])
def test_fp8_kernel_matches_torch_ops_on_the_same_values(m, k, n):
    """The Gluon kernel on e4m3 operands against fp64 ops on the same values, at the record's shape and sizes off
    every tile (300 = 2 x 128 + 44 rows, 80 < one k-step of 128, 528 = 4 x 128 + 16, as h's e4m3 copy needs
    16-byte rows). Hopper's FP8 MMA sums the products of each instruction (32 along K) with about 14 bits below the
    largest (DeepSeek-V3 technical report, 2024), so a pre-activation p may be off by d <= 32 * 2^-14 = 2^-9 times
    the sum of its terms' magnitudes; h = relu(p)^2 then by at most (2|p| + d) d, plus one bf16 rounding of h (2^-9
    relative, 2^-8 allowed). Tighter bounds failed: 2^-8 of each h by up to 0.0042 relative, 2^-12 for d by 0.004
    absolute at the record's shape."""
    x = normed(m, k, "cuda").bfloat16()
    w = (torch.randn(k, n, device="cuda") * 0.5 * k ** -0.5).bfloat16()
    x_scale, w_scale = normed_scale(x), scale_of(w)
    x8, w8 = to_e4m3(x, x_scale), to_e4m3(w.t(), w_scale).contiguous()
    scale = x_scale * w_scale
    h_scale = relu2_scale(w8, scale)
    got, got8 = mlp_kernels.relu2_matmul_fp8(x8, w8, scale, 1 / h_scale)
    assert got.dtype == torch.bfloat16 and got8.dtype == torch.float8_e4m3fn and got.shape == got8.shape == (m, n)
    x64, w64, s64 = x8.double(), w8.double().t(), scale.double()
    pre = (x64 @ w64) * s64
    want = F.relu(pre).square()
    d = 2.0 ** -9 * (x64.abs() @ w64.abs()) * s64  # from the sum of |x_k w_k| behind each pre-activation
    product_bound = (2.0 * pre.abs() + d) * d
    err = (got.double() - want).abs()
    bound = 2.0 ** -8 * want + product_bound
    assert (err <= bound).all(), (err - bound).max().item()
    assert err.max() > 0  # not trivially equal: the check compares two computations
    # the e4m3 copy: the same fp32 h, rounded to e4m3 at h_scale (2^-4 relative, or 2^-10 of the scale below the
    # normal range) instead of to bf16
    err8 = (got8.double() * h_scale.double() - want).abs()
    bound8 = 2.0 ** -4 * (want + product_bound) + product_bound + 2.0 ** -10 * h_scale.double()
    assert (err8 <= bound8).all(), (err8 - bound8).max().item()
    assert (got8.double() * h_scale.double() != got.double()).any()


@gpu
@hopper
@pytest.mark.parametrize("m, k, n", [(49152, 3072, 768), (300, 80, 520), (4100, 80, 1032)])
def test_fp8_matmul_add_matches_torch_ops_on_the_same_values(m, k, n):
    """r + s h8 @ w8^T on e4m3 operands against fp64 ops on the same values, at the record's shape (the MLP's
    second product) and sizes off every tile: the accumulation's error as in the test above, plus one bf16 rounding
    of the sum."""
    g = torch.Generator("cuda").manual_seed(4)
    h = F.relu(torch.randn(m, k, generator=g, device="cuda")).square()
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    r = torch.randn(m, n, generator=g, device="cuda").bfloat16()
    h_scale, w_scale = scale_of(h), scale_of(w)
    h8, w8 = to_e4m3(h, h_scale), to_e4m3(w, w_scale)
    got = mlp_kernels.matmul_add_fp8(h8, w8, h_scale * w_scale, r)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    h64, w64, s64 = h8.double(), w8.double().t(), (h_scale * w_scale).double()
    want = r.double() + (h64 @ w64) * s64
    bound = 2.0 ** -8 * want.abs() + 2.0 ** -9 * (h64.abs() @ w64.abs()) * s64
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (err - bound).max().item()
    assert err.max() > 0


@gpu
@hopper
def test_compiled_fp8_mlp_calls_the_fp8_kernel():
    """Under torch.compile the FP8 path calls the FP8 kernels' custom ops in the forward and the bf16 kernel in the
    backward, and gives the eager results."""
    import re

    from torch._inductor.utils import run_and_get_code

    g = torch.Generator("cuda").manual_seed(0)
    x = normed(4096, 768, "cuda").bfloat16()
    w1, w2 = [(torch.randn(768, 3072, generator=g, device="cuda") * 768 ** -0.5).bfloat16() for _ in range(2)]
    r, grad_y = [torch.randn(4096, 768, generator=g, device="cuda").bfloat16() for _ in range(2)]

    got, codes = run_and_get_code(grads, torch.compile(fp8_mlp, dynamic=False), x, w1, w2, r, grad_y)
    ops = sorted(re.findall(r"torch\.ops\.speedrun\.(\w+)\.default\(", "\n".join(codes)))
    assert ops == ["matmul_add_fp8", "relu2_matmul_fp8", "relu2_matmul_grad"]
    for a, b in zip(got, grads(fp8_mlp, x, w1, w2, r, grad_y), strict=True):
        torch.testing.assert_close(a, b)


@gpu
@hopper
@pytest.mark.parametrize("m, k, n", [(49152, 768, 3072), (4112, 80, 1040)])
def test_fp8_kernel_writes_the_transposed_copy(m, k, n):
    """relu2_matmul_fp8_t: h and its e4m3 copy equal relu2_matmul_fp8's bit for bit, and the transposed copy is
    that copy's transpose, at the record's shape and one off every tile (4112 = 32 x 128 + 16 tokens, 1040 = 8 x 128
    + 16 hidden units)."""
    x, w1 = normed(m, k, "cuda").bfloat16(), (torch.randn(k, n, device="cuda") * k ** -0.5).bfloat16()
    x8, w8, scale = normed_operands(x, w1)
    inv = 1 / relu2_scale(w8, scale)
    h, h8 = mlp_kernels.relu2_matmul_fp8(x8, w8, scale, inv)
    got_h, got8, got8t = mlp_kernels.relu2_matmul_fp8_t(x8, w8, scale, inv)
    assert torch.equal(got_h, h) and torch.equal(got8.view(torch.uint8), h8.view(torch.uint8))
    assert torch.equal(got8t.view(torch.uint8), h8.t().contiguous().view(torch.uint8))


@gpu
@hopper
@pytest.mark.parametrize("m, k, n", [(49152, 768, 3072), (4112, 80, 1040)])
@pytest.mark.parametrize("history", [1.0, 0.5])
def test_fp8_grad_kernel_matches_torch_ops(m, k, n, history):
    """relu2_matmul_grad_fp8 on the e4m3 operands of grad_operands against fp64 ops on the same values: the scale is
    grad_amax's delayed one; the transposed copy is the copy's transpose; the gradient g = p 2 sqrt(h), p = s gy8 @
    w8^T, is off by at most dg = 2 sqrt(h) d, d = 2^-9 s (|gy8| @ |w8|^T), Hopper's FP8 accumulation error (as in
    test_fp8_kernel_matches_torch_ops_on_the_same_values); grad_amax then lies within the largest dg of g's amax, and
    the copy, decoded, within one e4m3 rounding of g, saturated past the scale's range (half the true amax as
    history)."""
    x, w1, w2, _, grad_y = fp8_backward_operands(m, k, n, "cuda")
    h = mlp_kernels.relu2_matmul_fp8(*normed_operands(x, w1), torch.ones((), device="cuda"))[0]
    gy8, w2_8, gy_scale, w2_scale = grad_operands(grad_y, w2)
    gy64, w64, s64 = gy8.double(), w2_8.double().t(), (gy_scale * w2_scale).double()
    exact = mlp.relu2_matmul_grad(gy64 * s64, w64, h.double())
    dg = 2.0 ** -9 * ((gy64.abs() @ w64.abs()) * s64) * (2.0 * h.double().sqrt())
    amax = (history * exact.abs().max()).float()
    scale_before = delayed_scale(amax)
    g8, g8t, scale = mlp_kernels.relu2_matmul_grad_fp8(gy8, w2_8, gy_scale * w2_scale, h, amax)
    assert torch.equal(scale, scale_before)
    assert (amax.double() - exact.abs().max()).abs() <= dg.max() + 2.0 ** -23 * exact.abs().max()
    assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))
    clipped = exact.clamp(-E4M3_MAX * scale.item(), E4M3_MAX * scale.item())
    err = (decoded(g8, scale) - clipped).abs()
    bound = E4M3_RTOL * (clipped.abs() + dg) + dg + 2.0 ** -10 * scale.item()
    assert (err <= bound).all(), (err - bound).max().item()
    assert (g8.float().abs() == E4M3_MAX).sum() > (1 if history < 1 else 0) * m // 100


@gpu
@hopper
def test_compiled_fp8_backward_mlp_calls_the_fp8_kernels():
    """Under torch.compile the FP8 backward calls the two kernels that write the copies, updates grad_amax as in
    eager, and gives the eager results."""
    import re

    from torch._inductor.utils import run_and_get_code

    x, w1, w2, r, grad_y = fp8_backward_operands(4096, 768, 3072, "cuda")
    amax = torch.zeros((), device="cuda")
    grads(lambda *a: mlp.ReLU2MLP.apply(*a, True, amax), x, w1, w2, r, grad_y)  # amax's history
    history = amax.clone()
    want = grads(lambda *a: mlp.ReLU2MLP.apply(*a, True, amax), x, w1, w2, r, grad_y)
    assert torch.equal(amax, history) and history > 0  # the same gradient again, the same amax
    compiled = torch.compile(lambda *a: mlp.ReLU2MLP.apply(*a, True, amax), dynamic=False)
    got, codes = run_and_get_code(grads, compiled, x, w1, w2, r, grad_y)
    ops = sorted(re.findall(r"torch\.ops\.speedrun\.(\w+)\.default\(", "\n".join(codes)))
    assert ops == ["matmul_add_fp8", "relu2_matmul_fp8_t", "relu2_matmul_grad_fp8"]
    assert torch.equal(amax, history)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
