"""The speedrun GPT: architecture only (no distributed code, no device or environment choices, no file I/O)."""

from model.gpt import GPT, GPTConfig, flops_per_token

__all__ = ["GPT", "GPTConfig", "flops_per_token"]
