"""model/decode.py's KV cache against the full model: the same logits at every position, and sample.generate's greedy
tokens with the cache equal to a re-run of the whole model per token."""
import dataclasses

import pytest
import torch

import sample
from helpers import random_gpt
from model import decode
from model.decode import KVCache
from model.gpt import GPT, GPTConfig

BOS = 50256  # GPTConfig's bos_id, sample.py's <|endoftext|>
# every path of the model at once: value embeddings (layers 0, 1 and 4, 5), the value residual, a block without
# attention (2) and one without an MLP (3), the backout, U-net skips, short-window layers; blocks of 16 tokens, so
# that a window of 48 tokens (3 blocks; short layers 1 block) cuts a sequence of 100. The model fixture adds the
# key offset (long layers 0 and 5).
CONFIG = GPTConfig(num_layers=6, model_dim=64, num_heads=2, head_dim=16, num_value_embeds=2, value_residual=True,
                   no_attention_layers=(2,), no_mlp_layers=(3,), backout=True, short_window_layers=(1, 3, 4),
                   block_size=16)
WINDOW = 48


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "key_offset"])
def model(request) -> GPT:
    """A random fp32 model whose mixing weights and gates are random too, so every path changes the logits; without
    and with the key offset, which needs each chunk's first key to read the one before it."""
    model = random_gpt(dataclasses.replace(CONFIG, key_offset=request.param), seed=0, std=0.3)
    with torch.no_grad():
        for block in model.blocks:
            block.lambdas.normal_()
            if block.attn is not None:
                block.attn.value_lambdas.normal_()
                block.attn.gate_w.normal_()
        model.skip_weights.normal_()
        model.backout_weight.normal_()
    return model


def tokens_with_documents(rows: int, length: int, bos_at: list[int], seed: int) -> torch.Tensor:
    """Random token ids (rows, length), BOS first and at each of bos_at (shifted by the row, so rows differ)."""
    tokens = torch.randint(0, BOS, (rows, length), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = BOS
    for row in range(rows):
        tokens[row, [p + row for p in bos_at]] = BOS
    return tokens


def full_logits(model: GPT, tokens_BT: torch.Tensor, window: int) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(tokens_BT, torch.tensor(window))


def decoded_logits(model: GPT, tokens_BT: torch.Tensor, prompt_len: int, window: int) -> torch.Tensor:
    """The cache's logits (B, T, V): the prompt in two calls of several chunks each, then one token at a time."""
    cache = KVCache(model, tokens_BT.size(0), tokens_BT.size(1), window)
    pieces = [tokens_BT[:, :prompt_len // 2], tokens_BT[:, prompt_len // 2:prompt_len]]
    pieces += tokens_BT[:, prompt_len:].split(1, dim=1)
    with torch.no_grad():
        return torch.cat([model.head.logits(cache.extend(piece)) for piece in pieces], dim=1)


def test_cached_logits_equal_the_full_models_at_every_position(model, monkeypatch):
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 7)  # a prompt read in several attention calls
    # documents start at 0, 13 and 30 in the prompt of 40, and at 71 among the 60 decoded tokens (row 1: one later)
    tokens = tokens_with_documents(rows=2, length=100, bos_at=[13, 30, 71], seed=1)
    full = full_logits(model, tokens, WINDOW)
    got = decoded_logits(model, tokens, prompt_len=40, window=WINDOW)
    assert full.abs().max() > 5  # far from 0: the random head reads a stream that every path has changed
    assert (got - full).abs().max() < 1e-4  # fp32 roundings of other sums: 2.1e-5 at most seen
    # the window and the documents shape these logits: a test that ignored either could not pass
    assert (full_logits(model, tokens, 4 * WINDOW) - full).abs().max() > 0.1
    assert (full_logits(model, tokens.masked_fill(tokens == BOS, 7), WINDOW) - full).abs().max() > 0.1


def test_a_cache_refuses_tokens_beyond_its_capacity(model):
    cache = KVCache(model, 1, 20, WINDOW)
    cache.extend(tokens_with_documents(1, 20, [], seed=2))
    with pytest.raises(ValueError, match="20 cached tokens \\+ 1 new exceed the cache's capacity 20"):
        cache.extend(torch.tensor([[BOS]]))


def test_a_fast_gpt_decodes_as_the_plain_one(model):
    """FastGPT's blocks take other arguments; the cache reads only GPT's parameters and plain functions."""
    pytest.importorskip("triton")
    from model.fast.gpt import FastGPT
    fast = FastGPT(model.config).configure(torch.device("cpu"))
    fast.load_state_dict(model.state_dict())
    tokens = tokens_with_documents(rows=2, length=70, bos_at=[13, 50], seed=3)
    got = decoded_logits(fast.eval(), tokens, prompt_len=30, window=WINDOW)
    assert (got - full_logits(model, tokens, WINDOW)).abs().max() < 1e-4


def generate_without_cache(model: GPT, prompt: list[int], steps: int, window: int, max_context: int) -> list[int]:
    """sample.py's way before the cache: the whole model on the context's last max_context tokens for each token,
    greedy."""
    tokens = list(prompt)
    for _ in range(steps):
        logits_V = full_logits(model, torch.tensor([tokens[-max_context:]]), window)[0, -1, :sample.TEXT_VOCAB]
        tokens.append(int(logits_V.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("max_context", [200, 64])  # 64: the sample outgrows it, and the cache reads it afresh
def test_greedy_generate_equals_the_model_rerun_per_token(model, max_context):
    prompt = tokens_with_documents(rows=1, length=40, bos_at=[13, 30], seed=4)[0].tolist()
    got = sample.generate(model, prompt, max_new_tokens=50, temperature=0, top_k=0, num_samples=2, window=WINDOW,
                          max_context=max_context, generator=torch.Generator())
    want = generate_without_cache(model, prompt, 50, WINDOW, max_context)
    assert got == [want, want] and len(set(want)) > 5
