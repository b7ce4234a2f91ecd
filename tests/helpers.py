"""Shared test fixtures that are plain functions (imported by several test files)."""
import contextlib

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
