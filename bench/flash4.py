"""FlashAttention-4 (CuTe DSL, package `flash-attn-4`, not a dependency of this project) against FlexAttention's
Triton kernels at the training shape (GPU only).

    python -m bench.flash4 --out bench/results/flash4_1xH200.json [--shard /tmp/proxy/fineweb_train_000001.bin]

Needs `pip install --pre "flash-attn-4[cu13]"` (CUDA 13 builds of torch; plain `flash-attn-4` for CUDA 12). Four
ways to run one 49,152-token micro-batch, 6 heads of 128, bf16, at the throughput config's long window and its
short window, forward and forward + backward (median of REPEATS calls):
- flex_blocks: the model's rule and BlockMask (model/attention.py), FlexAttention's Triton template;
- flash_blocks: the same block lists through FlexAttention's FLASH backend (FA4 kernels, the mask_mod compiled to
  CuTe);
- flex_tokens: the exact token distance q - k < window (bench/flex_rule.py), Triton;
- fa4_tokens: FA4's own varlen kernel with the documents as sequences and its sliding window, no mask_mod. FA4's
  window is a token distance, so it can only run that rule.
Each FA4 row records its max abs difference to the Triton row of its rule (output and the three gradients).
"""
import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask

from bench.attention import BLOCK, SCALE, document_seqlens, flex_problem, tokens
from bench.flex_rule import LONG_WINDOW, REPEATS, token_window_mask
from bench.timing import cuda_times_ms
from data.shard import BOS_ID
from model.attention import block_mask, document_ids
from model.config import short_window, window_blocks

INSTALL = 'pip install --pre "flash-attn-4[cu13]" (or flash-attn-4 for a CUDA 12 build of torch)'


def flash_block_mask(doc_1T: torch.Tensor, window: torch.Tensor, block_size: int) -> BlockMask:
    """The model's BlockMask with a mask_mod that torch 2.11's CuTe lowering compiles. Indexing the (1, T) document
    ids by (b, q) fails there ("Expected TensorSSA, but got int": the batch index folds to the constant 0), so the
    ids are read as a flat (T,) tensor (one row per micro-batch, as in training); the window test is left out, as
    every listed pair passes it (model/attention.py)."""
    mask = block_mask(doc_1T, window, block_size)
    doc_T = doc_1T[0].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_T[q_idx] == doc_T[kv_idx])

    return BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                    mask.full_kv_indices, BLOCK_SIZE=block_size, mask_mod=mask_mod)


def main():
    from torch.nn.attention.flex_attention import flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard", help="a token shard whose first micro-batch supplies the documents")
    args = ap.parse_args()
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        raise SystemExit(f"bench.flash4 needs FlashAttention-4 ({e}): {INSTALL}")

    ids_T = tokens(args.shard).cuda()
    doc_1T = document_ids(ids_T[None], BOS_ID)
    cu_seqlens, max_len = document_seqlens(ids_T)
    long = torch.tensor(LONG_WINDOW, device="cuda")
    windows = {"long": long, "short": short_window(long, BLOCK)}
    (q, k, v, grad), result = flex_problem(windows, args.shard)
    result |= {"documents": len(cu_seqlens) - 1, "longest_document": max_len}
    # one graph per mask_mod, kernel options and grad mode: 12 here, past dynamo's default limit of 8, beyond which
    # flex_attention would run unfused (a T x T score matrix)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    flex = torch.compile(flex_attention, dynamic=False)

    def flex_call(mask, backend):
        return lambda: flex(q, k, v, block_mask=mask, scale=SCALE, kernel_options={"BACKEND": backend})

    def fa4_call(window):
        # (1, H, T, d) views of (1, T, H, d) storage -> (T, H, d) views (squeeze, not q[0]: indexing's backward
        # would fill a zero tensor and copy each gradient); flash's left window W admits k >= q - W
        def call():
            q_THd, k_THd, v_THd = (t.squeeze(0).transpose(0, 1) for t in (q, k, v))
            out = flash_attn_varlen_func(q_THd, k_THd, v_THd,
                                         cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len,
                                         max_seqlen_k=max_len, softmax_scale=SCALE, causal=True,
                                         window_size=(int(window) - 1, 0))
            out = out[0] if isinstance(out, tuple) else out  # (out, lse) in some releases
            return out.transpose(0, 1).unsqueeze(0)
        return call

    def forward_backward(fn):
        for t in (q, k, v):  # each call's gradients alone: no accumulation into the last call's
            t.grad = None
        out = fn()
        out.backward(grad)
        return out

    def outputs(fn):
        return [forward_backward(fn).detach()] + [t.grad for t in (q, k, v)]

    for name, window in windows.items():
        # window_blocks(w) blocks back under the model's rule; the token rule runs at the same nominal window
        blocks = int(window_blocks(window, BLOCK))
        backends = {"flex_blocks": flex_call(block_mask(doc_1T, window, BLOCK), "TRITON"),
                    "flash_blocks": flex_call(flash_block_mask(doc_1T, window, BLOCK), "FLASH"),
                    "flex_tokens": flex_call(token_window_mask(doc_1T, window, BLOCK), "TRITON"),
                    "fa4_tokens": fa4_call(window)}
        references = {"flash_blocks": "flex_blocks", "fa4_tokens": "flex_tokens"}
        row = {"window": int(window), "window_blocks": blocks}
        results = {n: outputs(fn) for n, fn in backends.items()}
        for n, ref in references.items():
            row[f"{n}_max_abs_diff_out_dq_dk_dv"] = [float((a.float() - b.float()).abs().max())
                                                     for a, b in zip(results[n], results[ref])]
        for n, fn in backends.items():
            with torch.no_grad():
                row[f"{n}_forward_ms"] = round(statistics.median(cuda_times_ms(fn, repeats=REPEATS)), 3)
            row[f"{n}_forward_backward_ms"] = round(statistics.median(
                cuda_times_ms(lambda: forward_backward(fn), repeats=REPEATS)), 3)
        result[name] = row
        print(json.dumps({name: row}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
