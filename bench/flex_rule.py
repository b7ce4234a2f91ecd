"""FlexAttention under the model's window rule (model/attention.py: whole blocks, record #28's) against the rule it
replaced, the exact token distance q - k < window, at the training shape (GPU only).

    python -m bench.flex_rule --out bench/results/flex_rule_1xH200.json [--shard /tmp/proxy/fineweb_train_000001.bin]

Under the exact distance, the pair of blocks at the window's edge is partial in every query block (mask_mod decides
per token); counted in whole blocks, only the diagonal and the blocks where a document starts are. One 49,152-token
micro-batch with the documents of --shard (bench/attention.py's synthetic ones without it), 6 heads of 128, bf16, at
the throughput config's long window and its short window: forward and forward + backward (median of REPEATS calls),
and how many (query block, key block) pairs each mask lists as full and as partial.
"""
import argparse
import json
import statistics
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from bench.attention import BLOCK, SCALE, flex_problem, tokens
from bench.timing import cuda_times_ms
from data.shard import BOS_ID
from model.attention import _ordered, block_mask, block_pairs, document_ids
from model.config import short_window

LONG_WINDOW = 896  # bench/run.py's throughput window
REPEATS = 30


def token_window_mask(doc_BT: Tensor, window: Tensor, block_size: int) -> BlockMask:
    """The BlockMask of the rule before: q may attend k iff k <= q, doc[k] == doc[q] and q - k < window. A block
    pair is full when its farthest pair is inside the window, partial when only its nearest is."""
    gap_QK, touching_BQK, one_doc_BQK = block_pairs(doc_BT, block_size)
    nearest_QK = torch.clamp_min((gap_QK - 1) * block_size + 1, 0)  # smallest q - k over the block pair
    farthest_QK = gap_QK * block_size + block_size - 1  # largest q - k over the block pair
    full_BQK = (gap_QK > 0) & one_doc_BQK & (farthest_QK < window)
    partial_BQK = (gap_QK >= 0) & touching_BQK & (nearest_QK < window) & ~full_BQK

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx]) & (q_idx - kv_idx < window)

    return BlockMask.from_kv_blocks(*_ordered(partial_BQK), *_ordered(full_BQK), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod)


def main():
    from torch.nn.attention.flex_attention import flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard", help="a token shard whose first micro-batch supplies the documents")
    args = ap.parse_args()

    doc_1T = document_ids(tokens(args.shard).cuda()[None], BOS_ID)
    long = torch.tensor(LONG_WINDOW, device="cuda")
    windows = {"long": long, "short": short_window(long, BLOCK)}
    rules = {"blocks": block_mask, "tokens": token_window_mask}
    (q, k, v, grad), result = flex_problem(windows, args.shard)
    result["rules"] = {}
    for rule, make in rules.items():
        torch._dynamo.reset()  # each rule's mask_mod is a graph of its own
        flex = torch.compile(flex_attention, dynamic=False)
        for wname, window in windows.items():
            mask = make(doc_1T, window, BLOCK)

            def run():
                return flex(q, k, v, block_mask=mask, scale=SCALE)

            with torch.no_grad():
                forward = statistics.median(cuda_times_ms(run, repeats=REPEATS))
            both = statistics.median(cuda_times_ms(lambda: run().backward(grad), repeats=REPEATS))
            for t in (q, k, v):
                t.grad = None
            row = {"full_pairs": int(mask.full_kv_num_blocks.sum()), "partial_pairs": int(mask.kv_num_blocks.sum()),
                   "forward_ms": round(forward, 3), "forward_backward_ms": round(both, 3)}
            result["rules"][f"{rule}_{wname}_{int(window)}"] = row
            print(rule, wname, json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
