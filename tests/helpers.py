"""Shared test fixtures that are plain functions (imported by several test files)."""
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch._dynamo

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
