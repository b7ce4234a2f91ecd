"""Sample text from a trained checkpoint.

    python sample.py --checkpoint logs/RUN --prompt "The meaning of life is" [--num_samples 3]
    python sample.py --checkpoint logs/RUN/ckpt_001750.pt --prompt "..." --temperature 0    # greedy

Each row starts with BOS, as every training document does. A sample ends at <|endoftext|> (the model would
start an unrelated document after it) or after --max_new_tokens.

No KV cache: each new token re-runs the model on the context (at most the training seq_len), padded to the length
the whole sample will have, so that every step has one shape and the compiled attention never recompiles:
O(final length) work per token instead of O(1). A cache would have to live inside model/: the
attention there reads the whole sequence at once (document ids, sliding windows, value residual and value
embeddings are computed per call), so caching means a second, incremental code path through every layer. At
the lengths people sample (a few hundred tokens) one re-run of the 124M model takes milliseconds on a GPU.
"""
import argparse
import math
import sys

import torch

from data.shard import BOS_ID
from data.tokenizer import get_encoding
from model.gpt import GPT
from runtime.checkpoint import load_model
from runtime.dist import choose_device
from runtime.errors import exit_on_user_error

TEXT_VOCAB = BOS_ID + 1  # ids above <|endoftext|> only pad the vocabulary to a multiple of 128; never sampled


def pick(logits_BV: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """Next token per row (B,): argmax at temperature 0, else a draw from the top_k (0 = all) tempered probs."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    if top_k:
        kth_BV = torch.topk(logits_BV, min(top_k, logits_BV.size(-1)), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_BV, -math.inf)
    # shifted so that the largest is 0 before the division: a tiny temperature then gives -inf, never inf - inf = nan
    tempered_BV = (logits_BV - logits_BV.amax(dim=-1, keepdim=True)) / temperature
    return torch.multinomial(torch.softmax(tempered_BV, dim=-1), 1, generator=generator)[:, 0]


def padded_length(prompt_len: int, max_new_tokens: int, block: int, max_context: int) -> int:
    """The one length generate feeds the model: the longest context it will see, rounded up to a whole attention
    block (FlexAttention's unit). FlexAttention on a GPU compiles each new length (after 8, dynamo gives up and runs
    it unfused), so the length stays fixed while the sample grows."""
    return min(max_context, math.ceil((prompt_len + max_new_tokens) / block) * block)


def pad_to(tokens_BN: torch.Tensor, length: int) -> torch.Tensor:
    """The context padded with BOS to `length`; causal attention never looks at the padding, so the real positions'
    outputs do not change."""
    return torch.nn.functional.pad(tokens_BN, (0, length - tokens_BN.size(1)), value=BOS_ID)


@torch.no_grad()
def generate(model: GPT, prompt: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
             num_samples: int, window: int, max_context: int, generator: torch.Generator) -> list[list[int]]:
    """The new tokens of `num_samples` continuations of `prompt` (token ids, BOS first); generation stops early
    once every sample has produced <|endoftext|>.

    `window` is the attention window in tokens (the one the model ended training with), `max_context` the
    longest context fed to the model (its training seq_len).
    """
    device = next(model.parameters()).device
    length = padded_length(len(prompt), max_new_tokens, model.config.block_size, max_context)
    tokens_BN = torch.tensor([prompt] * num_samples, dtype=torch.int32, device=device)
    window_t = torch.tensor(window, dtype=torch.int64, device=device)
    ended_B = torch.zeros(num_samples, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        context_BN = tokens_BN[:, -max_context:]
        hidden_BD = model.hidden_states(pad_to(context_BN, length), window_t)[:, context_BN.size(1) - 1]
        logits_BV = model.head.logits(hidden_BD)[:, :TEXT_VOCAB]
        next_B = pick(logits_BV, temperature, top_k, generator)
        tokens_BN = torch.cat([tokens_BN, next_B[:, None].to(tokens_BN.dtype)], dim=1)
        ended_B |= next_B == BOS_ID
        if ended_B.all():  # every sample is complete (main cuts each at its <|endoftext|>)
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
    args = parser.parse_args(argv)
    for name, low in (("max_new_tokens", 0), ("temperature", 0), ("top_k", 0), ("num_samples", 1)):
        if not getattr(args, name) >= low:  # also refuses nan
            raise ValueError(f"--{name}={getattr(args, name)} must be at least {low}")
    if math.isinf(args.temperature):
        raise ValueError("--temperature=inf would draw every token alike: give a finite temperature (0 = greedy)")

    device = choose_device(args.device, local_rank=0)
    model, train_config = load_model(args.checkpoint, device)
    enc = get_encoding()
    prompt = [BOS_ID] + enc.encode_ordinary(args.prompt)
    if len(prompt) > train_config["seq_len"]:
        print(f"note: the prompt is {len(prompt):,} tokens with its <|endoftext|> start; the model reads only the last "
              f"{train_config['seq_len']:,} (its training --seq_len)", file=sys.stderr)
    generator = torch.Generator(device).manual_seed(args.seed)
    samples = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, num_samples=args.num_samples, window=train_config["window_max_tokens"],
                       max_context=train_config["seq_len"], generator=generator)
    for i, new in enumerate(samples):
        if BOS_ID in new:
            new = new[:new.index(BOS_ID)]
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples}")
        print(enc.decode(prompt[1:] + new))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
