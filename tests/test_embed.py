"""The gradient-routing Functions of model/layers.py: FanOut (one tensor, n readers, their gradients summed in one
call) and TableRows (embedding rows whose gradient is added straight into the table's .grad), against autograd; and
the Triton kernel of model/embed_kernels.py against fp64 sums.

The kernel runs on a GPU (`pytest -m gpu`) at the training's size, and on the CPU through the Triton interpreter
where triton is installed, in a child pytest (`test_kernels_in_the_triton_interpreter`; see tests/helpers.py)."""

import pytest
import torch
import torch.nn.functional as F

from helpers import interpreted, interpreter_parent
from model import layers

gpu = pytest.mark.gpu


def test_fan_out_sums_the_gradients_of_its_readers_in_one_call():
    """Three readers, one of them outside the graph (its gradient None): one call of `add`, with the two present
    gradients, and x gets what autograd gives x read twice."""
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    calls = []

    def add(tensors):
        calls.append(len(tensors))
        return layers.add_all(tensors)

    a, b, c = layers.FanOut.apply(x, 3, add)
    assert all(v.shape == x.shape and v.data_ptr() == x.data_ptr() for v in (a, b, c))
    w1, w2 = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    ((a * w1).sum() + (b * w2).sum() + c.detach().sum()).backward()
    assert calls == [2]
    torch.testing.assert_close(x.grad, w1 + w2, rtol=0, atol=0)


def test_table_rows_add_their_gradient_into_the_table_in_place():
    """The first backward makes table.grad (zeros + the rows' gradients); the second adds to that same tensor.
    Repeated tokens add up; the table's value never enters; the result equals autograd through F.embedding."""
    table = torch.randn(10, 6, requires_grad=True)
    ids = torch.tensor([[3, 1, 3], [9, 3, 0]], dtype=torch.int32)  # token 3 three times
    grads = [torch.randn(2, 3, 6) for _ in range(2)]
    rows = F.embedding(ids, table.detach())
    layers.TableRows.apply(rows, table, ids).backward(grads[0])
    first = table.grad
    layers.TableRows.apply(rows, table, ids).backward(grads[1])
    assert table.grad is first  # accumulated in place

    reference = table.detach().clone().requires_grad_()
    for g in grads:
        F.embedding(ids.long(), reference).backward(g)
    torch.testing.assert_close(table.grad, reference.grad)
    assert table.grad[[2, 4, 5, 6, 7, 8]].eq(0).all()


def test_table_rows_forward_is_the_rows():
    table = torch.randn(10, 6, requires_grad=True)
    rows = torch.randn(2, 3, 6, dtype=torch.bfloat16)
    out = layers.TableRows.apply(rows, table, torch.zeros(2, 3, dtype=torch.int64))
    assert out.requires_grad and out.dtype == torch.bfloat16 and torch.equal(out, rows)
    with torch.no_grad():
        assert not layers.TableRows.apply(rows, table, torch.zeros(2, 3, dtype=torch.int64)).requires_grad


def check_add_rows(num_rows, vocab, width, device):
    """add_rows on bf16 rows into an fp32 table against fp64 sums: within 1e-5 of the summed magnitudes of each
    element (fp32 atomics in any order). The ids repeat as text does: a third of the rows are one token."""
    from model import embed_kernels

    gen = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, vocab, (num_rows,), generator=gen, device=device, dtype=torch.int32)
    ids[::3] = 7
    grad = torch.randn(num_rows, width, generator=gen, device=device).to(torch.bfloat16)
    table = torch.randn(vocab, width, generator=gen, device=device)
    want = table.double().index_add(0, ids.long(), grad.double())
    bound = table.double().abs().index_add(0, ids.long(), grad.double().abs())
    embed_kernels.add_rows(table, ids, grad)
    assert ((table.double() - want).abs() <= 1e-5 * bound + 1e-30).all()


@gpu
@pytest.mark.parametrize("num_rows, vocab, width", [(49152, 50304, 768), (1000, 77, 100)])
def test_add_rows_on_gpu(num_rows, vocab, width):
    """The record's micro-batch, and a row width that is not a power of two."""
    check_add_rows(num_rows, vocab, width, "cuda")


@gpu
def test_table_rows_on_gpu_match_autograd():
    """The Function on the kernel: the table's gradient over two backward passes against autograd's through
    F.embedding in fp32, to the rounding of fp32 sums in another order."""
    table = torch.randn(50304, 768, device="cuda", requires_grad=True)
    ids = torch.randint(0, 50304, (1, 4096), device="cuda", dtype=torch.int32)
    ids[:, ::4] = 11
    grads = [torch.randn(1, 4096, 768, device="cuda").to(torch.bfloat16) for _ in range(2)]
    rows = F.embedding(ids, table.detach()).to(torch.bfloat16)
    reference = table.detach().clone().requires_grad_()
    for g in grads:
        layers.TableRows.apply(rows, table, ids).backward(g)
        F.embedding(ids.long(), reference).backward(g.float())
    torch.testing.assert_close(table.grad, reference.grad, rtol=1e-5, atol=1e-5)


# --- CPU, Triton interpreter --------------------------------------------------------------------------------------
test_kernels_in_the_triton_interpreter = interpreter_parent(__file__, 1)


@interpreted
def test_interpreted_add_rows():
    check_add_rows(300, 20, 100, "cpu")
