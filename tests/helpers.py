"""Shared test fixtures that are plain functions (imported by several test files)."""
import contextlib
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch._dynamo

from model.fast.int8_decode import E4M3_MAX
from model.gpt import GPT, GPTConfig


@contextlib.contextmanager
def recorded_compile(model: GPT):
    """model.compile_regions() with a backend that records each graph dynamo hands over and runs it uncompiled;
    yields the list of graphs. Dynamo starts afresh with its default recompile limit (8), and is reset after."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8):  # compile_regions raises it as needed; undone after
        try:
            model.compile_regions(backend=backend)
            yield graphs
        finally:
            torch._dynamo.reset()


def output_and_grads(fn, *args) -> list:
    """[fn(*inputs), then each input's gradient] for args = (*inputs, upstream gradient of fn's one output), the inputs
    taken as fresh leaves: how the kernel test files compare an autograd.Function with autograd through torch ops."""
    *inputs, upstream = args
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(upstream)
    return [out.detach()] + [t.grad for t in leaves]


# A kernel test file's tests that run only under the Triton interpreter, in interpreter_parent's child
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs in test_kernels_in_the_triton_interpreter's child")


INTERPRETED_FILES: list[str] = []  # the kernel test files that bound interpreter_parent, as pytest imported them
_interpreted: dict[str, tuple[int, str]] = {}  # file -> (its interpreted tests that passed, the child's output)


def interpreter_parent(test_file: str, passed: int, *marks):
    """The test that runs test_file's `interpreted` tests in a child process (run_interpreted), for a kernel test file
    to bind as test_kernels_in_the_triton_interpreter; it skips where triton is not installed and in the child."""
    INTERPRETED_FILES.append(test_file)

    @pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch)")
    @pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the child itself")
    def test_kernels_in_the_triton_interpreter():
        run_interpreted(test_file, passed)

    test_kernels_in_the_triton_interpreter.__doc__ = f"The {passed} interpreted test(s) of {Path(test_file).name}, " \
                                                     f"in a child process with TRITON_INTERPRET=1."
    for mark in marks:
        test_kernels_in_the_triton_interpreter = mark(test_kernels_in_the_triton_interpreter)
    return test_kernels_in_the_triton_interpreter


def run_interpreted(test_file: str, passed: int) -> None:
    """Assert that exactly `passed` of test_file's tests marked by "interpreted" in their name ran and passed in a
    child pytest with TRITON_INTERPRET=1, which must be set before triton decorates the kernels (when model/fast's
    modules import them). The first call runs one child for every collected kernel test file not yet run, which saves
    a process start and triton's import per file; each file's test then reads its own count."""
    if test_file not in _interpreted:
        files = [f for f in INTERPRETED_FILES if f not in _interpreted] or [test_file]
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "interpreted.xml"
            env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {"TRITON_INTERPRET": "1"}
            child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k",
                                    "interpreted", f"--junitxml={report}"], cwd=Path(__file__).parents[1], env=env,
                                   capture_output=True, text=True, timeout=900)
            cases = list(ET.parse(report).getroot().iter("testcase")) if report.exists() else []
        output = (child.stdout + child.stderr)[-8000:]
        for f in files:
            module = Path(f).stem
            ok = [c for c in cases if c.get("classname", "").split(".")[-1] == module
                  and not any(c.find(tag) is not None for tag in ("failure", "error", "skipped"))]
            _interpreted[f] = (len(ok), output)
    count, output = _interpreted[test_file]
    assert count == passed, f"{count} of {passed} interpreted tests of {Path(test_file).name} passed\n{output}"


def random_gpt(config: GPTConfig, seed: int, std: float) -> GPT:
    """A seeded fp32 GPT (SDPA, eval mode) whose output projections (N(0, std)) and head (N(0, 1)) are random
    instead of zero, so its logits depend on every earlier token."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for block in model.blocks:
            for part in (block.attn, block.mlp):
                if part is not None:  # a block may go without one (GPTConfig.no_attention_layers)
                    part.proj_w.normal_(std=std)
        model.head.weight.normal_()
    model.compute_dtype = torch.float32
    model.attention_backend = "sdpa"
    return model.eval()


E4M3_HALF_ULP = 2.0 ** -4  # e4m3's rounding error on normal values, relative: half its 3-bit mantissa's step
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # e4m3's spacing below 2^-6, its smallest normal value


class Int8Scales(NamedTuple):
    """What the rounding of INT8/FP8 attention (model/fast) depends on, in fp64: the INT8 scale of each query's q (or
    dq) (B, T, H) and of each key's k' (B, K, H), the rounded k' (B, K, H, d), and V's e4m3 scales (B, H, d)."""
    q_BTH: torch.Tensor
    k_BKH: torch.Tensor
    k_hat_BKHd: torch.Tensor
    v_BHd: torch.Tensor


def int8_score_bound(q_BTHd, scales: Int8Scales, scale: float) -> torch.Tensor:
    """A bound eps (B, H, T, K) on the scores' errors: q (or dq) and k' round to their INT8 grids (errors <= sq / 2,
    sk / 2 per element), so a score's error |e_q k'^ + q e_k| scale is at most scale (sq / 2 |k'^|_1 + sk / 2 |q|_1),
    k'^ the rounded key."""
    q_scale_BHT1, k_scale_BH1K = scales.q_BTH.transpose(1, 2)[..., None], scales.k_BKH.transpose(1, 2)[:, :, None]
    k_hat_l1_BH1K = scales.k_hat_BKHd.abs().sum(-1).transpose(1, 2)[:, :, None]
    q_l1_BHT1 = q_BTHd.double().abs().sum(-1).transpose(1, 2)[..., None]
    return scale * (q_scale_BHT1 / 2 * k_hat_l1_BH1K + k_scale_BH1K / 2 * q_l1_BHT1)


def int8_score_variance(q_BTHd, scales: Int8Scales, scale: float) -> torch.Tensor:
    """var(s) (B, H, T, K) = scale^2 (sq^2 / 12 |k'^|^2 + sk^2 / 12 |q|^2): int8_score_bound's errors taken as
    independent and uniform over their steps."""
    q_scale_BHT1, k_scale_BH1K = scales.q_BTH.transpose(1, 2)[..., None], scales.k_BKH.transpose(1, 2)[:, :, None]
    k_hat_sq_BH1K = (scales.k_hat_BKHd ** 2).sum(-1).transpose(1, 2)[:, :, None]
    q_sq_BHT1 = (q_BTHd.double() ** 2).sum(-1).transpose(1, 2)[..., None]
    return scale ** 2 * (q_scale_BHT1 ** 2 / 12 * k_hat_sq_BH1K + k_scale_BH1K ** 2 / 12 * q_sq_BHT1)


def int8_error_bound(q_BTHd, v_BKHd, visible_BTK, scales: Int8Scales, scale: float) -> torch.Tensor:
    """A bound (B, T, H, d) on |INT8/FP8 attention - exact attention| of q over K keys, visible_BTK the mask.

    Scores off by at most eps (int8_score_bound) move the softmax weights by at most e^(2 eps) - 1 in L1, so the
    output by that times max_j |v_jc| over the visible keys. e4m3 then rounds each P and V value to within
    E4M3_HALF_ULP relative (normal values) or half a subnormal step absolute; the weights sum to 1, so those add
    (2 E4M3_HALF_ULP + E4M3_HALF_ULP^2) max_j |v_jc|, half a subnormal step of v_scale for V, and, for P, n keys'
    half steps over the row sum (>= 1, the max's own)."""
    seen_B1TK = visible_BTK[:, None]
    eps_BHT = int8_score_bound(q_BTHd, scales, scale).masked_fill(~seen_B1TK, 0).amax(dim=-1)
    v_abs_BHKd = v_BKHd.double().abs().transpose(1, 2)
    vmax_BHTd = torch.where(seen_B1TK[..., None], v_abs_BHKd[:, :, None], 0).amax(dim=3)  # over the visible keys
    relative_BHT1 = torch.expm1(2 * eps_BHT)[..., None] + 2 * E4M3_HALF_ULP + E4M3_HALF_ULP ** 2
    p_steps_B1T1 = visible_BTK.sum(-1).double()[:, None, :, None] * E4M3_SUBNORMAL_STEP / 2 / E4M3_MAX
    v_step_BH1d = E4M3_SUBNORMAL_STEP / 2 * scales.v_BHd[:, :, None, :]
    return (((relative_BHT1 + p_steps_B1T1) * vmax_BHTd + v_step_BH1d) * (1 + E4M3_HALF_ULP)).transpose(1, 2)


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3's values around each |x| (448 at most)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6)))
    return torch.where(x.abs() < 2.0 ** -6, E4M3_SUBNORMAL_STEP, 2.0 ** (exponent - 3))


def int8_error_variance(q_BTHd, k_BKHd, v_BKHd, visible_BTK, scales: Int8Scales, scale: float) -> torch.Tensor:
    """The variance (B, T, H, d) of INT8/FP8 attention - exact attention, each rounding taken as an independent error
    uniform over its step (variance step^2 / 12): with weights w_j, to first order

        var(o_c) = sum_j w_j^2 (var(s_j) (v_jc - o_c)^2 + var(P_j) / P_j^2 v_jc^2 + var(v_jc)),

    var(s_j) from INT8 (int8_score_variance), and e4m3's steps for 448 P_j (P relative to the row's max) and for
    v_jc / v_scale_c."""
    q, v = q_BTHd.double().transpose(1, 2), v_BKHd.double().transpose(1, 2)  # (B, H, T or K, d)
    var_s = int8_score_variance(q_BTHd, scales, scale)
    s = (scale * q @ k_BKHd.double().transpose(1, 2).mT).masked_fill(~visible_BTK[:, None], -math.inf)
    w = torch.softmax(s, dim=-1)
    o = w @ v
    p = w / w.amax(dim=-1, keepdim=True) * E4M3_MAX
    rel_var_p = torch.where(p > 0, (e4m3_step(p) / p.clamp_min(1e-300)) ** 2 / 12, 0)
    v_scale = scales.v_BHd[:, :, None, :]
    var_v = (e4m3_step(v / v_scale) * v_scale) ** 2 / 12
    w2 = w ** 2
    scores = (torch.einsum("bhqk,bhkc->bhqc", w2 * var_s, v ** 2)
              - 2 * o * torch.einsum("bhqk,bhkc->bhqc", w2 * var_s, v) + o ** 2 * (w2 * var_s).sum(-1, keepdim=True))
    return (scores + (w2 * rel_var_p) @ v ** 2 + w2 @ var_v).transpose(1, 2)
