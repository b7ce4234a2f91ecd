"""Attention alone at the training shape (GPU only): FlexAttention against `torch.nn.attention.varlen.varlen_attn`
(FlashAttention-2 over the documents as variable-length sequences, with its sliding window), forward and forward +
backward, at the long and short windows of the throughput config. Flash's window is the exact token distance, so
flex runs that rule here (bench/flex_rule.py's mask; the model's windows count whole blocks, model/attention.py).

    python -m bench.attention --out bench/results/attention_1xH200.json [--shard /tmp/proxy/fineweb_train_000001.bin]

One 49,152-token micro-batch, 6 heads of 128, bf16; median of REPEATS after WARMUP calls, CUDA events. The
documents are the first micro-batch of --shard when given, else lengths drawn from a geometric distribution with
the proxy corpus's mean. Both backends must agree (max abs difference of the outputs, recorded).
"""
import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.timing import median_ms
from data.shard import BOS_ID, read_shard
from model.attention import document_ids

T, H, D_HEAD, SCALE, BLOCK = 48 * 1024, 6, 128, 0.12, 128
WINDOWS = (896, 448)  # bench/run.py's throughput window and its short-window layers' half
MEAN_DOC = 1000  # synthetic documents only: roughly FineWeb's mean length in GPT-2 tokens


def tokens(shard: str | None) -> torch.Tensor:
    if shard:
        return torch.from_numpy(read_shard(shard)[:T].astype(np.int64))
    gen = np.random.default_rng(0)
    ids = np.zeros(T, dtype=np.int64)
    starts = np.cumsum(gen.geometric(1 / MEAN_DOC, size=T))
    ids[starts[starts < T]] = BOS_ID
    ids[0] = BOS_ID
    return torch.from_numpy(ids)


def document_seqlens(ids_T: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32, longest document) of a token row, for flash's varlen kernels: each BOS opens a document,
    and tokens before the first one are a document of their own."""
    starts = torch.nonzero(ids_T == BOS_ID).flatten()
    starts = starts[starts > 0]
    cu_seqlens = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), ids_T.numel())]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def flex_problem(windows: dict, shard: str | None) -> tuple[list[torch.Tensor], dict]:
    """For the FlexAttention benches (bench/flex_options.py, bench/flex_rule.py): q, k, v (leaves) and an output
    gradient, (1, H, T, d) views of (1, T, H, d) storage as the model's blocks pass them, bf16, seeded; and the
    result's header."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(1, T, H, D_HEAD, device="cuda", generator=gen, dtype=torch.bfloat16)
                     .transpose(1, 2) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "T": T, "heads": H,
              "head_dim": D_HEAD, "windows": {n: int(w) for n, w in windows.items()},
              "source": shard or "geometric lengths (bench/attention.py)"}
    return [q, k, v, grad], header


def main():
    from torch.nn.attention.flex_attention import flex_attention
    from torch.nn.attention.varlen import varlen_attn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard", help="a token shard whose first micro-batch supplies the documents")
    args = ap.parse_args()

    from bench.flex_rule import token_window_mask  # imports this module's constants: imported late

    ids_T = tokens(args.shard).cuda()
    doc_1T = document_ids(ids_T[None], BOS_ID)
    cu_seqlens, max_len = document_seqlens(ids_T)

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, H, D_HEAD, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    grad = torch.randn(T, H, D_HEAD, device="cuda", generator=gen, dtype=torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_(True)
    flex = torch.compile(flex_attention, dynamic=False)

    def run_flex(mask):
        # (T, H, d) -> (1, H, T, d) views, as the model's blocks pass them
        out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
                   scale=SCALE)
        return out[0].transpose(0, 1)

    def run_varlen(window):
        # flash's left window W admits k >= q - W; ours admits q - k < window
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=SCALE,
                           window_size=(window - 1, 0))

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "T": T, "heads": H,
              "head_dim": D_HEAD, "documents": len(cu_seqlens) - 1, "longest_document": max_len,
              "source": args.shard or f"geometric lengths, mean {MEAN_DOC}"}
    for window in WINDOWS:
        mask = token_window_mask(doc_1T, torch.tensor(window, device="cuda"), BLOCK)
        backends = {"flex": lambda: run_flex(mask), "varlen": lambda: run_varlen(window)}
        row = {}
        with torch.no_grad():
            outs = {name: fn() for name, fn in backends.items()}
            row["max_abs_diff"] = float((outs["flex"].float() - outs["varlen"].float()).abs().max())
            for name, fn in backends.items():
                row[f"{name}_forward_ms"] = median_ms(fn)
        for name, fn in backends.items():
            row[f"{name}_forward_backward_ms"] = median_ms(lambda: fn().backward(grad))
        result[f"window_{window}"] = row
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
