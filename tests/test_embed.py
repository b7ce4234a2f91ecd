"""The gradient-routing Functions of model/fast/routing.py: FanOut (one tensor, n readers, their gradients summed in one
call) and TableRows (embedding rows whose gradient is added straight into the table's .grad), against autograd; and
the Triton kernel of model/fast/embed_kernels.py against fp64 sums.

The kernel runs on a GPU (`pytest -m gpu`) at the training's size, and on the CPU through the Triton interpreter
where triton is installed, in a child pytest (`test_kernels_in_the_triton_interpreter`; see tests/helpers.py)."""

import pytest
import torch
import torch.nn.functional as F

from helpers import interpreted, interpreter_parent

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast import embed_kernels, routing

gpu = pytest.mark.gpu


def test_fan_out_sums_the_gradients_of_its_readers_in_one_call():
    """Three readers, one of them outside the graph (its gradient None): one call of `add`, with the two present
    gradients, and x gets what autograd gives x read twice."""
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    calls = []

    def add(tensors):
        calls.append(len(tensors))
        return routing.add_all(tensors)

    a, b, c = routing.FanOut.apply(x, 3, add)
    assert all(v.shape == x.shape and v.data_ptr() == x.data_ptr() for v in (a, b, c))
    w1, w2 = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    ((a * w1).sum() + (b * w2).sum() + c.detach().sum()).backward()
    assert calls == [2]
    torch.testing.assert_close(x.grad, w1 + w2, rtol=0, atol=0)


def route(rows, table, ids, readers):
    """TableRows as FastGPT.hidden_states applies it: the ids sorted once, one view per reader."""
    return routing.TableRows.apply(rows, table, *routing.sort_ids(ids), readers)


def test_table_rows_add_their_gradient_into_the_table_in_place():
    """Two readers, over two backward passes: the first makes table.grad (zeros + the rows' gradients), the second
    adds to that same tensor. Repeated tokens add up; the table's value never enters; the result equals autograd
    through F.embedding read twice."""
    table = torch.randn(10, 6, requires_grad=True)
    ids = torch.tensor([[3, 1, 3], [9, 3, 0]], dtype=torch.int32)  # token 3 three times
    grads = [torch.randn(2, 3, 6) for _ in range(4)]
    rows = F.embedding(ids, table.detach())
    first_reader, second_reader = route(rows, table, ids, 2)
    ((first_reader * grads[0]).sum() + (second_reader * grads[1]).sum()).backward()
    first = table.grad
    first_reader, second_reader = route(rows, table, ids, 2)
    ((first_reader * grads[2]).sum() + (second_reader * grads[3]).sum()).backward()
    assert table.grad is first  # accumulated in place

    reference = table.detach().clone().requires_grad_()
    for g in grads:
        F.embedding(ids.long(), reference).backward(g)
    torch.testing.assert_close(table.grad, reference.grad)
    assert table.grad[[2, 4, 5, 6, 7, 8]].eq(0).all()


def test_table_rows_skip_a_reader_without_gradient():
    """A reader the loss does not read (a layer without attention) sends no gradient, not zeros to add."""
    table = torch.randn(10, 6, requires_grad=True)
    ids = torch.tensor([[3, 1, 3]])
    g = torch.randn(1, 3, 6)
    used, unused = route(F.embedding(ids, table.detach()), table, ids, 2)
    (used * g).sum().backward()
    torch.testing.assert_close(table.grad, torch.zeros(10, 6).index_add(0, ids.flatten(), g[0]))


def test_table_rows_forward_is_the_rows():
    table = torch.randn(10, 6, requires_grad=True)
    rows = torch.randn(2, 3, 6, dtype=torch.bfloat16)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    views = route(rows, table, ids, 2)
    assert len(views) == 2
    assert all(v.requires_grad and v.dtype == torch.bfloat16 and torch.equal(v, rows) for v in views)
    with torch.no_grad():
        assert not any(v.requires_grad for v in route(rows, table, ids, 2))


def test_sort_ids_orders_the_flattened_ids():
    ids = torch.tensor([[5, 1, 5], [0, 9, 1]])
    sorted_ids, order = routing.sort_ids(ids)
    assert sorted_ids.tolist() == [0, 1, 1, 5, 5, 9]
    assert torch.equal(ids.flatten()[order], sorted_ids)


def test_sort_ids_keeps_the_order_of_each_ids_rows():
    """A stable sort: within a run of one id the rows keep their order in the micro-batch, so the kernels sum each run
    in the same order every time."""
    ids = torch.randint(0, 20, (5, 20), generator=torch.Generator().manual_seed(0))
    sorted_ids, order = routing.sort_ids(ids)
    same = sorted_ids[1:] == sorted_ids[:-1]
    assert same.sum() > 50 and (order[1:][same] > order[:-1][same]).all()


def check_add_rows(num_rows, vocab, width, readers, device, **launch):
    """add_rows on bf16 rows into an fp32 table against fp64 sums: within 1e-5 of the summed magnitudes of each
    element (fp32 sums in any order). The ids repeat as text does: a third of the rows are one token, whose run
    crosses many programs' rows. `launch`: add_rows' rows per program and warps."""
    gen = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, vocab, (num_rows,), generator=gen, device=device, dtype=torch.int32)
    ids[::3] = 7
    grads = [torch.randn(num_rows, width, generator=gen, device=device).to(torch.bfloat16) for _ in range(readers)]
    table = torch.randn(vocab, width, generator=gen, device=device)
    total = sum(g.double() for g in grads)
    want = table.double().index_add(0, ids.long(), total)
    bound = table.double().abs().index_add(0, ids.long(), sum(g.double().abs() for g in grads))
    embed_kernels.add_rows(table, *routing.sort_ids(ids), grads, **launch)
    assert ((table.double() - want).abs() <= 1e-5 * bound + 1e-30).all()


@gpu
@pytest.mark.parametrize("num_rows, vocab, width", [(49152, 50304, 768), (1000, 77, 100)])
@pytest.mark.parametrize("readers", [1, 2])
def test_add_rows_on_gpu(num_rows, vocab, width, readers):
    """The record's micro-batch, and a row count and width that are not multiples of the kernel's blocks."""
    check_add_rows(num_rows, vocab, width, readers, "cuda")


@gpu
def test_add_rows_on_gpu_repeats_bit_for_bit():
    """The record's micro-batch with a third of its rows one token (a run through some 500 programs, as a file of code
    makes in the proxy corpus): ten calls into copies of one table give the same bits. With one atomic add per
    program, the adds into that token's row came in a different order each call."""
    gen = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, 50304, (49152,), generator=gen, device="cuda", dtype=torch.int32)
    ids[::3] = 7
    grads = [torch.randn(49152, 768, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
    table = torch.randn(50304, 768, generator=gen, device="cuda")
    sorted_ids, order = routing.sort_ids(ids)
    results = []
    for _ in range(10):
        results.append(table.clone())
        embed_kernels.add_rows(results[-1], sorted_ids, order, grads)
    assert all(torch.equal(r, results[0]) for r in results[1:])
    assert not torch.equal(results[0], table)


@gpu
def test_table_rows_on_gpu_match_autograd():
    """The Function on the kernel: the table's gradient over two backward passes of two readers against autograd's
    through F.embedding in fp64, within 1e-5 of the summed magnitudes (fp32 sums in another order)."""
    table = torch.randn(50304, 768, device="cuda", requires_grad=True)
    ids = torch.randint(0, 50304, (1, 4096), device="cuda", dtype=torch.int32)
    ids[:, ::4] = 11
    rows = F.embedding(ids, table.detach()).to(torch.bfloat16)
    reference = table.detach().double().requires_grad_()
    magnitude = torch.zeros_like(reference)
    for _ in range(2):
        grads = [torch.randn(1, 4096, 768, device="cuda").to(torch.bfloat16) for _ in range(2)]
        views = route(rows, table, ids, 2)
        sum((v.float() * g.float()).sum() for v, g in zip(views, grads)).backward()
        for g in grads:
            F.embedding(ids.long(), reference).backward(g.double())
            magnitude.index_add_(0, ids.flatten().long(), g[0].double().abs())
    assert ((table.grad.double() - reference.grad).abs() <= 1e-5 * magnitude + 1e-30).all()


# --- CPU, Triton interpreter --------------------------------------------------------------------------------------
test_kernels_in_the_triton_interpreter = interpreter_parent(__file__, 4)


@interpreted
@pytest.mark.parametrize("readers", [1, 2])
@pytest.mark.parametrize("num_rows, rows, parts", [(300, 32, embed_kernels._PARTS), (200, 2, 16)])
def test_interpreted_add_rows(monkeypatch, readers, num_rows, rows, parts):
    """At 2 rows a program, the run of token 7 in 200 rows (about 75 rows) goes on through about 38 programs: more
    than the second kernel adds in one step, here 16 (_PARTS, a constant of the launch)."""
    monkeypatch.setattr(embed_kernels, "_PARTS", parts)
    check_add_rows(num_rows, 20, 100, readers, "cpu", rows=rows)
