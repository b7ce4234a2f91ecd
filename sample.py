"""Sample text from a trained checkpoint.

    python sample.py --checkpoint logs/RUN --prompt "The meaning of life is" [--num_samples 3]
    python sample.py --checkpoint logs/RUN/ckpt_001750.pt --prompt "..." --temperature 0    # greedy
    python sample.py --checkpoint logs/RUN --prompt "..." --attention_forward int8          # INT8/FP8 attention

Rows start with BOS, as training documents do, and end at <|endoftext|> or after --max_new_tokens. A KV cache
(model/decode.py) reads the prompt once, then each new token alone. The context is at most the training seq_len:
past it, each token re-reads the last seq_len tokens into a fresh cache, so no position exceeds those trained on.
"""
import argparse
import math
import sys
from collections.abc import Collection

import torch

from data.shard import BOS_ID
from data.tokenizer import get_encoding
from evals.validation import int8_rule
from model.decode import KVCache
from model.gpt import GPT
from runtime.checkpoint import load_model
from runtime.config import ATTENTION_FORWARDS
from runtime.dist import choose_device
from runtime.errors import UserError, exit_on_user_error

TEXT_VOCAB = BOS_ID + 1  # ids above <|endoftext|> are padding, never sampled


def pick(logits_BV: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """Next token per row (B,): argmax at temperature 0, else a draw from the top_k (0 = all) tempered probs."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    if top_k:
        kth_BV = torch.topk(logits_BV, min(top_k, logits_BV.size(-1)), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_BV, -math.inf)
    # max shifted to 0 first, so a tiny temperature gives -inf, never inf - inf = nan
    tempered_BV = (logits_BV - logits_BV.amax(dim=-1, keepdim=True)) / temperature
    return torch.multinomial(torch.softmax(tempered_BV, dim=-1), 1, generator=generator)[:, 0]


def choose_int8_layers(model: GPT, prompt: list[int], window: int, max_context: int) -> tuple[set[int], str]:
    """The attention layers whose INT8/FP8 output is off their SDPA output by at most INT8_MAX_ERROR (relative L1)
    on a prefill of the prompt's last max_context tokens, as validation's rule; and the errors as a line for
    stderr."""
    tokens_1T = torch.tensor([prompt[-max_context:]], dtype=torch.int32, device=next(model.parameters()).device)
    cache = KVCache(model, 1, tokens_1T.size(1), window, measure_int8=True)
    cache.extend(tokens_1T)
    errors = cache.int8_errors()
    on, line = int8_rule(list(errors.values()))
    return {layer for layer, keep in zip(errors, on) if keep}, line


@torch.no_grad()
def generate(model: GPT, prompt: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
             num_samples: int, window: int, max_context: int, generator: torch.Generator,
             int8_layers: Collection[int] = ()) -> list[list[int]]:
    """The new tokens of `num_samples` continuations of `prompt` (ids, BOS first), stopping once all have ended.
    `window`: the attention window the model ended training with; `max_context`: its training seq_len;
    `int8_layers`: the attention layers that attend in INT8/FP8 (KVCache)."""
    device = next(model.parameters()).device
    tokens_BN = torch.tensor([prompt] * num_samples, dtype=torch.int32, device=device)
    capacity = min(max_context, len(prompt) + max_new_tokens)
    ended_B = torch.zeros(num_samples, dtype=torch.bool, device=device)
    cache, new_BT = None, tokens_BN
    for _ in range(max_new_tokens):
        if cache is None or cache.length == max_context:  # the prompt, or a full context
            cache, new_BT = KVCache(model, num_samples, capacity, window, int8_layers), tokens_BN[:, -max_context:]
        hidden_BD = cache.extend(new_BT)[:, -1]
        logits_BV = model.head.logits(hidden_BD)[:, :TEXT_VOCAB]
        next_B = pick(logits_BV, temperature, top_k, generator)
        new_BT = next_B[:, None].to(tokens_BN.dtype)
        tokens_BN = torch.cat([tokens_BN, new_BT], dim=1)
        ended_B |= next_B == BOS_ID
        if ended_B.all():  # main cuts each at its <|endoftext|>
            break
    return tokens_BN[:, len(prompt):].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python sample.py", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a ckpt_<step>.pt file or the run folder holding it")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    parser.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate per sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--num_samples", type=int, default=1, help="independent samples of the prompt")
    parser.add_argument("--attention_forward", default="bf16", choices=ATTENTION_FORWARDS,
                        help="bf16 (SDPA) or int8 (INT8/FP8 attention where a layer's error on the prompt allows)")
    args = parser.parse_args(argv)
    for name, low in (("max_new_tokens", 0), ("temperature", 0), ("top_k", 0), ("num_samples", 1)):
        if not getattr(args, name) >= low:  # also refuses nan
            raise UserError(f"--{name}={getattr(args, name)} must be at least {low}")
    if math.isinf(args.temperature):
        raise UserError("--temperature=inf would draw every token alike: give a finite temperature (0 = greedy)")

    device = choose_device(args.device, local_rank=0)
    model, train_config = load_model(args.checkpoint, device)
    enc = get_encoding()
    prompt = [BOS_ID] + enc.encode_ordinary(args.prompt)
    if len(prompt) > train_config["seq_len"]:
        print(f"note: the prompt is {len(prompt):,} tokens with its <|endoftext|> start; the model reads only the last "
              f"{train_config['seq_len']:,} (its training --seq_len)", file=sys.stderr)
    window, max_context = train_config["window_max_tokens"], train_config["seq_len"]
    int8_layers = set()
    if args.attention_forward == "int8":
        int8_layers, line = choose_int8_layers(model, prompt, window, max_context)
        print(line, file=sys.stderr)
    generator = torch.Generator(device).manual_seed(args.seed)
    samples = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, num_samples=args.num_samples, window=window, max_context=max_context,
                       generator=generator, int8_layers=int8_layers)
    for i, new in enumerate(samples):
        if BOS_ID in new:
            new = new[:new.index(BOS_ID)]
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples}")
        print(enc.decode(prompt[1:] + new))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
