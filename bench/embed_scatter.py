"""The value embeddings' backward at the training size: f8bbdeb's add_rows (one program per token row, one atomic
add each; model/embed_kernels.py's kernel until 0ed78a8, kept here as the baseline) against model/embed_kernels.py's
add_rows, which sorts the ids, sums each run of equal ids in registers and adds only the sums (fewer atomics, none on
the same address from thousands of rows of one token), at 8-64 rows per program and 2 or 4 warps.

    python -m bench.embed_scatter --out X.json --shard /tmp/proxy/fineweb_train_000001.bin

Each value-embedding table has two readers (a first and a last layer), so autograd sums two (N, A) gradients
before TableRows' backward scatters them. The "pair" rows time that add plus the scatter, against add_rows reading
both gradients itself. Ids come from the shard (the first 49,152 tokens) and, for contrast, uniformly at random. Each
result is compared with the baseline's table, which adds the pair summed in bf16. Then: whether ten calls give the
same bits, and the second kernel's programs per group (add_rows' `group`) on the shard's first 8 micro-batches.

Measured on the H200, in CUDA graphs, the sort included in add_rows:
- Single-pass kernel (bench/results/embed_scatter_1xH200.json; each run that crossed programs finished with atomic
  adds in no fixed order). The proxy shard's first micro-batch holds 2,318 distinct ids, one of them (a file of code)
  16,929 times. There, the baseline took 225 us, the pair 280 us; the sorted kernel 93-110 us, the pair 102-114 us
  (sort alone 42 us). Uniform ids: the baseline 108 us, the pair 162 us; sorted 136-148 us, the pair 148-152 us. So
  the gain is in the repeats, and text repeats tokens (in the training step: 193.7 us a table before, 47.8 us a call
  after, kernels_step28_1xH200_f8bbdeb.txt against kernels_step28_1xH200_gate_sum_experiment.txt).
- With the second kernel, which adds those runs' pieces in program order
  (bench/results/embed_scatter_1xH200_deterministic.json, at 32 programs a group): on the shard's ids the pair took
  117.8 us at the model's 32 rows and 2 warps, uniform ids 148.0 us; ten calls gave the same bits on both. On the
  first 8 micro-batches, sort left out, the pair took 66.6, 64.0, 69.7 and 70.9 us a batch at groups of 4, 8, 16
  and 32 programs, the same bits on the first micro-batch.
- The difference from the baseline's table is up to 1.0 on the shard's ids and 0.038 on uniform ones: the
  reference's bf16 sum of the pair, rounded once per row and summed over 16,929 rows; tests/test_embed.py checks
  the model's kernel against fp64.
"""
import argparse
import json

import numpy as np
import torch
import triton
import triton.language as tl

from bench.timing import cuda_bf16_randn, graph_ms
from data.shard import read_shard
from model import embed_kernels, layers

N, V, A = 49152, 50304, 768


@triton.jit
def _add_rows_kernel(grad_ptr, ids_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    token = tl.load(ids_ptr + row).to(tl.int64)
    g = tl.load(grad_ptr + row * width + cols, mask=inside).to(tl.float32)
    tl.atomic_add(out_ptr + token * width + cols, g, mask=inside, sem="relaxed")


def add_rows(out, ids, grad):
    """The baseline: out[ids[n]] += grad[n], one program per row."""
    _add_rows_kernel[(ids.size(0),)](grad, ids, out, out.size(1), BLOCK=triton.next_power_of_2(out.size(1)),
                                     num_warps=4)


def add_sorted_rows(out, ids, grad_a, grad_b=None, rows=32, warps=4):
    """The sort, then model/embed_kernels.py's add_rows at the given rows per program and warps."""
    sorted_ids, order = layers.sort_ids(ids)
    embed_kernels.add_rows(out, sorted_ids, order, [grad_a] if grad_b is None else [grad_a, grad_b], rows, warps)


def groups_on_text(shard, grad_a, grad_b, table, groups=(4, 8, 16, 32), batches=8):
    """The pair on the shard's first `batches` micro-batches (as the training step meets them) at each of add_rows'
    `groups`: the mean ms a micro-batch, the sort left out, and whether every group gives the first batch the same
    bits."""
    result, first = {}, None
    batch_ids = [torch.from_numpy(shard[b * N:(b + 1) * N].astype(np.int32)).cuda() for b in range(batches)]
    for group in groups:
        times = []
        for ids in batch_ids:
            sorted_ids, order = layers.sort_ids(ids)
            times.append(graph_ms(lambda: embed_kernels.add_rows(table, sorted_ids, order, [grad_a, grad_b],
                                                                 group=group)))
        result[f"text{batches}/pair group={group}"] = sum(times) / batches
        got = torch.zeros(V, A, device="cuda")
        embed_kernels.add_rows(got, *layers.sort_ids(batch_ids[0]), [grad_a, grad_b], group=group)
        first = got if first is None else first
        result[f"text{batches}/pair group={group} same bits as group={groups[0]}"] = torch.equal(got, first)
    return result


def repeats_bit_for_bit(ids, grad_a, grad_b, count=10):
    """Do `count` calls of add_sorted_rows (the model's rows and warps) into zero tables give the same bits?"""
    first = None
    for _ in range(count):
        got = torch.zeros(V, A, device="cuda")
        add_sorted_rows(got, ids, grad_a, grad_b, embed_kernels._ROWS, embed_kernels._WARPS)
        if first is None:
            first = got
        elif not torch.equal(got, first):
            return False
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    shard = read_shard(args.shard)
    text_ids = torch.from_numpy(shard[:N].astype(np.int32)).cuda()
    random_ids = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32)
    grad_a, grad_b = cuda_bf16_randn(N, A), cuda_bf16_randn(N, A)
    table = torch.zeros(V, A, device="cuda")
    results = {"unique_text_ids": int(text_ids.unique().numel()),
               "top_text_id_count": int(torch.bincount(text_ids.long()).max())}
    for name, ids in (("text", text_ids), ("random", random_ids)):
        results[f"{name}/add_rows"] = graph_ms(lambda: add_rows(table, ids, grad_a))
        results[f"{name}/pair: add + add_rows"] = graph_ms(lambda: add_rows(table, ids, grad_a + grad_b))
        results[f"{name}/sort_ids"] = graph_ms(lambda: layers.sort_ids(ids))
        want = torch.zeros(V, A, device="cuda")
        add_rows(want, ids, grad_a + grad_b)
        for rows in (8, 16, 32, 64):
            for warps in (2, 4):
                results[f"{name}/sorted rows={rows} warps={warps}"] = graph_ms(
                    lambda: add_sorted_rows(table, ids, grad_a, None, rows, warps))
                results[f"{name}/pair sorted rows={rows} warps={warps}"] = graph_ms(
                    lambda: add_sorted_rows(table, ids, grad_a, grad_b, rows, warps))
                got = torch.zeros(V, A, device="cuda")
                add_sorted_rows(got, ids, grad_a, grad_b, rows, warps)
                results[f"{name}/pair sorted rows={rows} warps={warps} max_abs_diff"] = (got - want).abs().max().item()
        results[f"{name}/pair repeats bit for bit"] = repeats_bit_for_bit(ids, grad_a, grad_b)
        print(json.dumps({k: v for k, v in results.items() if k.startswith(name)}, indent=1), flush=True)
    results.update(groups_on_text(shard, grad_a, grad_b, table))
    print(json.dumps({k: v for k, v in results.items() if "group" in k}, indent=1), flush=True)
    json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
