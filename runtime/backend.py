"""The one place that chooses how the model runs: the plain GPT of model/gpt.py, or FastGPT (model/fast: fused
Triton/Gluon kernels and FP8) on CUDA."""
from importlib.metadata import PackageNotFoundError, version

import torch

from model.config import GPTConfig
from model.gpt import GPT
from runtime.errors import UserError

TRITON_PIN = "triton==3.6.0"  # the Triton the kernels are tested with (pyproject.toml pins the torch that brings it)
# Triton releases whose interpreted kernel tests pass: the pinned one, and the newest checked
TESTED_TRITON = ("3.6", "3.8")


def wants_kernels(kernels: str, device: torch.device) -> bool:
    """Whether --kernels asks for model/fast on `device`: auto takes them on CUDA; 1 on another device is refused."""
    if kernels == "1" and device.type != "cuda":
        raise UserError(f"--kernels=1: the fused kernels run on CUDA GPUs, and this run is on {device}; drop "
                        f"--kernels (auto) or pass --kernels=0 for the plain model")
    return kernels == "1" or (kernels == "auto" and device.type == "cuda")


def untested_triton() -> str | None:
    """The installed Triton's version where it is not one of TESTED_TRITON (None where it is, or none is installed)."""
    try:
        found = version("triton")
    except PackageNotFoundError:  # a CPU build of torch brings none
        return None
    return None if found.startswith(tuple(v + "." for v in TESTED_TRITON)) else found


def check_int8_attention(device: torch.device, kernels: str, head_dim: int) -> None:
    """A UserError where INT8/FP8 attention cannot run: it is a fused kernel (model/fast) with FP8 products (8.9+)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < (8, 9) or kernels == "0":
        where = f"compute capability {capability}" if capability else str(device)
        raise UserError(f"--attention_forward=int8 runs in the fused kernels on CUDA GPUs of compute capability 8.9 "
                        f"or newer (FP8 products), with --kernels auto or 1; this run has {where} and "
                        f"--kernels={kernels}: use --attention_forward=bf16")
    if head_dim % 16 or head_dim & (head_dim - 1):
        raise UserError(f"--attention_forward=int8 needs a power-of-two head_dim of at least 16 (its kernel's tiles); "
                        f"this model has {head_dim}: use --attention_forward=bf16")


def build_model(config: GPTConfig, device: torch.device, kernels: str = "auto", fp8: bool = True,
                attention_forward: str = "bf16") -> tuple[GPT, list[str]]:
    """(the model on `device`, its weights not yet initialised; notes for the run's log). A CUDA run whose kernels
    cannot load stops with the import error and the fix, instead of quietly training without them."""
    notes = []
    if attention_forward == "int8":
        check_int8_attention(device, kernels, config.head_dim)
    untested = kernels == "auto" and device.type == "cuda" and untested_triton()
    if untested:
        notes.append(f"note: triton {untested} is not one the fused kernels are tested with "
                     f"({', '.join(TESTED_TRITON)}): training the plain model; --kernels=1 uses the kernels anyway")
    if untested or not wants_kernels(kernels, device):
        if attention_forward == "int8":
            raise UserError(f"--attention_forward=int8 runs in the fused kernels, which triton {untested} is not "
                            f"tested with: pass --kernels=1 to use them anyway, or --attention_forward=bf16")
        if fp8 and device.type == "cuda":
            notes.append("note: --fp8 applies to the fused kernels; the plain model (--kernels=0) runs bf16")
        return GPT(config).to(device).configure(device), notes
    try:
        from model.fast.gpt import FastGPT
    except ImportError as e:
        raise UserError(f"the fused kernels (model/fast) could not load ({e}); install the tested pair "
                        f"(pip install ., which pins torch 2.11.0 and with it {TRITON_PIN}), or pass --kernels=0 to "
                        f"train the plain model") from None
    model = FastGPT(config).to(device).configure(device, fp8=fp8)
    used = model.fp8_in_use()
    if fp8 and not all(used.values()):
        capability = torch.cuda.get_device_capability(device)
        off = " and ".join(part for part, on in used.items() if not on)
        notes.append(f"note: this GPU (compute capability {capability}) runs the {off} in bf16: their FP8 products "
                     f"need {'Hopper (9.x)' if not used['blocks'] else '8.9 or newer'}; pass --fp8=0 to make that "
                     f"explicit")
    return model, notes
