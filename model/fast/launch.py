"""How model/fast's Triton kernels are launched inside their torch.library.triton_ops."""
import triton
from torch.library import wrap_triton


def launcher(kernel):
    """wrap_triton(kernel), through which torch.compile sees the launch; under the Triton interpreter
    (TRITON_INTERPRET=1, the kernels' CPU tests) the kernel itself, as torch 2.11's wrap_triton refuses interpreted
    kernels."""
    return kernel if triton.knobs.runtime.interpret else wrap_triton(kernel)
