"""FlexAttention's mask_mod forms at the training shape (GPU only): what the per-token test of the partial block
pairs costs, for the block lists of the model's rule (model/attention.py, block_mask).

    python -m bench.flex_mask --out bench/results/flex_mask_1xH200.json [--shard /tmp/proxy/fineweb_train_000001.bin]

Forms, all on the same full and partial block lists:
- doc_pair: the model's, doc[q] == doc[k] and k <= q and the window's test (two gathers of document ids);
- doc_start: start[q] <= k <= q and the window's test, start[q] the position of q's document's first token (one
  gather, indexed by the query alone);
- doc_start_nowin: the same without the window's test, which every listed pair passes;
- causal_only: k <= q alone, wrong where a document starts inside a pair; the floor of what a mask_mod costs.
The first three must give the same outputs and gradients (recorded). One 49,152-token micro-batch, 6 heads of 128,
bf16, the long and short windows of the throughput config; forward, and forward + backward by torch.autograd.grad
(no gradient accumulation); median of REPEATS calls.
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
from model.attention import block_mask, document_ids
from model.config import short_window, window_blocks

LONG_WINDOW = 896  # bench/run.py's throughput window
REPEATS = 30
FORMS = ("doc_pair", "doc_start", "doc_start_nowin", "causal_only")  # the first is the model's, the reference


def mask_with(form: str, ids_BT: Tensor, window: Tensor, block_size: int) -> BlockMask:
    """model.attention.block_mask's block lists for token ids (B, T), with the mask_mod `form`."""
    doc_BT = document_ids(ids_BT, BOS_ID)
    pos_BT = torch.arange(ids_BT.size(1), device=ids_BT.device).expand_as(ids_BT)
    start_BT = torch.cummax(torch.where(ids_BT == BOS_ID, pos_BT, 0), dim=1).values.to(torch.int32)
    blocks = window_blocks(window, block_size)

    def in_window(q_idx, kv_idx):
        return q_idx // block_size - kv_idx // block_size < blocks

    lists = block_mask(doc_BT, window, block_size)
    forms = {
        "doc_pair": lists.mask_mod,  # the model's own
        "doc_start": lambda b, h, q, k: (k <= q) & (k >= start_BT[b, q]) & in_window(q, k),
        "doc_start_nowin": lambda b, h, q, k: (k <= q) & (k >= start_BT[b, q]),
        "causal_only": lambda b, h, q, k: k <= q,
    }
    return BlockMask.from_kv_blocks(lists.kv_num_blocks, lists.kv_indices, lists.full_kv_num_blocks,
                                    lists.full_kv_indices, BLOCK_SIZE=block_size, mask_mod=forms[form])


def main():
    from torch.nn.attention.flex_attention import flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard", help="a token shard whose first micro-batch supplies the documents")
    args = ap.parse_args()

    ids_1T = tokens(args.shard).cuda()[None]
    long = torch.tensor(LONG_WINDOW, device="cuda")
    windows = {"long": long, "short": short_window(long, BLOCK)}
    (q, k, v, grad), result = flex_problem(windows, args.shard)
    result["forms"] = {}
    reference = {}
    for form in FORMS:
        torch._dynamo.reset()  # each form's mask_mod is a graph of its own
        flex = torch.compile(flex_attention, dynamic=False)
        for wname, window in windows.items():
            mask = mask_with(form, ids_1T, window, BLOCK)

            def run():
                return flex(q, k, v, block_mask=mask, scale=SCALE)

            def run_both():
                return torch.autograd.grad(run(), (q, k, v), grad)

            with torch.no_grad():
                forward = statistics.median(cuda_times_ms(run, repeats=REPEATS))
            both = statistics.median(cuda_times_ms(run_both, repeats=REPEATS))
            outs = [run().detach(), *run_both()]
            row = {"forward_ms": round(forward, 3), "forward_backward_ms": round(both, 3)}
            if form == FORMS[0]:
                reference[wname] = outs
            else:
                row["max_abs_diff_out_dq_dk_dv"] = [float((a.float() - b.float()).abs().max())
                                                    for a, b in zip(outs, reference[wname])]
            result["forms"][f"{form}_{wname}_{int(window)}"] = row
            print(form, wname, json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
