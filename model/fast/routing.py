"""Gradient routing between the blocks of model/fast/gpt.py: the U-net skip's add (SkipAdd), one tensor read by
many (FanOut) and embedding rows whose gradient goes straight into the table's (TableRows). On CUDA SkipAdd and
TableRows run Triton kernels; elsewhere the torch ops beside them, the kernels' references.

Shape legend: B batch rows, T tokens, A row width, N = B T tokens, V vocab.
"""
import torch
from torch import Tensor

from model.fast import embed_kernels, skip_kernels


def skip_add(x: Tensor, s: Tensor, w: Tensor) -> Tensor:
    """x + w s for the U-net skip, w a 0-D weight."""
    return x + w.type_as(x) * s


class SkipAdd(torch.autograd.Function):
    """x + w s with its gradients (g, w g, sum(g s))."""

    @staticmethod
    def forward(ctx, x: Tensor, s: Tensor, w: Tensor) -> Tensor:
        ctx.on_kernels = x.is_cuda
        ctx.save_for_backward(s, w)
        return skip_kernels.skip_add(x, s, w) if ctx.on_kernels else skip_add(x, s, w)

    @staticmethod
    def backward(ctx, grad: Tensor):
        s, w = ctx.saved_tensors
        if ctx.on_kernels:
            grad_s, grad_w = skip_kernels.skip_add_grad(grad.contiguous(), s, w)
        else:
            grad_s, grad_w = w.type_as(grad) * grad, (grad * s).sum().to(w.dtype)
        return grad, grad_s, grad_w


def add_all(tensors: list[Tensor]) -> Tensor:
    """The sum of same-shaped tensors: FanOut's `add`, compiled into one kernel."""
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


class FanOut(torch.autograd.Function):
    """n views of one tensor whose gradients the backward sums in one call of `add` (list -> sum), one pass over
    memory instead of autograd's n - 1."""

    @staticmethod
    def forward(ctx, t: Tensor, n: int, add) -> tuple[Tensor, ...]:
        ctx.add = add
        ctx.set_materialize_grads(False)  # an unused view sends None
        return tuple(t.view_as(t) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        present = [g for g in grads if g is not None]
        return ctx.add(present) if present else None, None, None


def sort_ids(ids_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(sorted ids, order) (N,) of the flattened ids, the order TableRows' backward walks."""
    return torch.sort(ids_BT.flatten(), stable=True)  # stable: each run of one id is summed in the same order


def add_rows(out_VA: Tensor, sorted_ids_N: Tensor, order_N: Tensor, grads_NA: list[Tensor]) -> None:
    """out[sorted_ids[i]] += the fp32 sum of the grads' rows order[i], in place."""
    total_NA = grads_NA[0].float()
    for g in grads_NA[1:]:
        total_NA = total_NA + g.float()
    out_VA.index_add_(0, sorted_ids_N.long(), total_NA[order_N.long()].to(out_VA.dtype))


class TableRows(torch.autograd.Function):
    """Rows of an embedding `table`, looked up outside autograd, as one view per reader; the backward adds their
    gradients straight into table.grad, so autograd.grad and gradient hooks never see the table. At most two readers
    on CUDA."""

    @staticmethod
    def forward(ctx, rows_BTA: Tensor, table_VA: Tensor, sorted_ids_N: Tensor, order_N: Tensor,
                readers: int) -> tuple[Tensor, ...]:
        ctx.table = table_VA
        ctx.set_materialize_grads(False)  # an unused reader sends None
        ctx.save_for_backward(sorted_ids_N, order_N)
        return tuple(rows_BTA.view_as(rows_BTA) for _ in range(readers))

    @staticmethod
    def backward(ctx, *grads_BTA: Tensor | None):
        (sorted_ids_N, order_N), table = ctx.saved_tensors, ctx.table
        if table.grad is None:
            table.grad = torch.zeros_like(table)
        present = [g.flatten(0, -2).contiguous() for g in grads_BTA if g is not None]
        if present:
            on_kernels = present[0].is_cuda
            (embed_kernels.add_rows if on_kernels else add_rows)(table.grad, sorted_ids_N, order_N, present)
        return None, None, None, None, None
