"""Shared test fixtures that are plain functions (imported by several test files)."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

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


def run_interpreted(test_file: str, passed: int) -> None:
    """Run test_file's tests marked by "interpreted" in their name in a child pytest with TRITON_INTERPRET=1, which
    must be set before triton decorates the kernels (when model.head / model.layers import them); assert that
    exactly `passed` ran and passed."""
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k",
                            "interpreted"], cwd=Path(__file__).parents[1], env={**os.environ, "TRITON_INTERPRET": "1"},
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0 and f"{passed} passed" in child.stdout.splitlines()[-1], child.stdout + child.stderr


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
