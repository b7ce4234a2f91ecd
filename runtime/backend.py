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


def build_model(config: GPTConfig, device: torch.device, kernels: str = "auto",
                fp8: bool = True) -> tuple[GPT, list[str]]:
    """(the model on `device`, its weights not yet initialised; notes for the run's log). A CUDA run whose kernels
    cannot load stops with the import error and the fix, instead of quietly training without them."""
    notes = []
    untested = kernels == "auto" and device.type == "cuda" and untested_triton()
    if untested:
        notes.append(f"note: triton {untested} is not one the fused kernels are tested with "
                     f"({', '.join(TESTED_TRITON)}): training the plain model; --kernels=1 uses the kernels anyway")
    if untested or not wants_kernels(kernels, device):
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
