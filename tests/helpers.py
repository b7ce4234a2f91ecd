"""Shared test fixtures that are plain functions (imported by several test files)."""
import torch

from model.gpt import GPT, GPTConfig


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
