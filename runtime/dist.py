"""Process setup: which device, which rank, and the process group when torchrun started several processes."""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.cli import parse_config
from runtime.config import PRESETS, TrainConfig
from runtime.errors import UserError


@dataclasses.dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK under torchrun

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def choose_device(flag: str, local_rank: int) -> torch.device:
    if flag not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device={flag!r} is not a device; use --device auto, cuda or cpu")
    if flag == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        gpus = nvidia_device_files()
        if flag == "cuda" or gpus:  # auto goes to the CPU only where there is no GPU to use
            raise UserError(no_usable_gpu(flag, gpus))
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} are visible; "
                        f"start torchrun with --nproc_per_node={torch.cuda.device_count()}")
    check_kernel_toolchain()
    return torch.device("cuda", local_rank)


def device_for_flags(argv: list[str]) -> torch.device:
    """The device train_gpt2 would take with these flags (its first process), or the UserError it would stop with.
    run.sh asks before it downloads FineWeb: where torch cannot use the machine's GPUs, the run then stops in the
    seconds torch takes to load, not after minutes of download."""
    return choose_device(parse_config(TrainConfig, argv, PRESETS).device, 0)


def nvidia_device_files(dev: str = "/dev") -> list[str]:
    """The NVIDIA GPUs' device files (/dev/nvidia0, ...; not nvidiactl or nvidia-uvm): present where the driver runs
    and, in a container, where it was started with the GPUs (--gpus), whatever this torch build can do with them."""
    names = [name for name in os.listdir(dev) if re.fullmatch(r"nvidia\d+", name)] if os.path.isdir(dev) else []
    return [os.path.join(dev, name) for name in sorted(names, key=lambda name: int(name.removeprefix("nvidia")))]


# the torch build a CUDA 12 driver runs, named in both messages below and in the README's first section
CUDA12_TORCH = "`pip install torch --index-url https://download.pytorch.org/whl/cu128` for a CUDA 12 driver"


def no_usable_gpu(flag: str, gpus: list[str]) -> str:
    """Why torch sees no GPU, and the fix. Where the machine has GPUs, --device auto stops here instead of training
    on the CPU: the torch that pip installs by default (2.14.1+cu130 here on 2026-12-01) cannot use a driver older
    than CUDA 13 (nvidia-smi's "CUDA Version"), and under torchrun the record model then trained in CPU processes."""
    if not gpus:
        return ("--device cuda, but no CUDA GPU is visible (torch.cuda.is_available() is False, and there is no "
                "/dev/nvidia0): check nvidia-smi (in Docker: docker run --gpus all), or train on the CPU with "
                "--device cpu")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hides_every_gpu(hidden, len(gpus)):
        cause, fix = f"CUDA_VISIBLE_DEVICES={hidden!r} leaves torch none", "unset it or name GPUs that exist"
    elif torch.version.cuda is None:
        cause = f"torch {torch.__version__} is a CPU-only build"
        fix = f"install a CUDA build of torch for your driver, e.g. {CUDA12_TORCH} (nvidia-smi shows its CUDA Version)"
    else:
        cause = (f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cannot use them "
                 f"(torch.cuda.is_available() is False{driver_cuda_note()})")
        fix = f"install the torch build for your driver's CUDA, e.g. {CUDA12_TORCH}, or update the driver"
    return (f"{'--device cuda: ' * (flag == 'cuda')}this machine has NVIDIA GPUs ({', '.join(gpus)}), but {cause}: "
            f"{fix}; or train on the CPU with --device cpu")


def hides_every_gpu(visible: str, gpus: int) -> bool:
    """Whether CUDA_VISIBLE_DEVICES=`visible` leaves CUDA no GPU on a machine of `gpus`: CUDA reads the list up to
    its first entry that names none, so an empty or out-of-range first entry hides all. GPU and MIG UUIDs cannot be
    checked here; they count as naming a GPU (schedulers such as SLURM set the variable on every job)."""
    first = visible.split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return False
    return not (first.isdigit() and int(first) < gpus)


def driver_cuda_note() -> str:
    """"; the driver runs CUDA up to X" from nvidia-smi's header, or nothing where it says nothing."""
    try:
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    found = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return f"; the driver runs CUDA up to {found.group(1)}" if found else ""


def check_kernel_toolchain() -> None:
    """Refuse a CUDA device that Triton could not build kernels for: choose_device asks for every entry point
    (train_gpt2 before anything is written, sample.py, evals.hellaswag).

    The first time each kind of Triton kernel runs (ours, or inductor's), Triton compiles a small C extension: its
    launcher. That takes a C compiler ($CC, else gcc, else clang) and Python's headers, looked up as Triton 3.6 does
    (triton/runtime/build.py). Without them the run failed in the first kernel launch with the compiler's command
    line, or FileNotFoundError, as its message (bench/results/triton_toolchain_1xH200.txt)."""
    compiler = os.environ.get("CC")
    if compiler:
        no_compiler = "" if shutil.which(compiler) else f"a C compiler (CC={compiler!r} is not a program)"
    else:
        no_compiler = ("" if shutil.which("gcc") or shutil.which("clang") else
                       "a C compiler (neither gcc nor clang is on PATH, and CC is unset)")
    scheme = sysconfig.get_default_scheme()
    header = Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"],
                  "Python.h")
    no_headers = "" if header.is_file() else f"Python's headers ({header} is missing)"
    missing = [need for need in (no_compiler, no_headers) if need]
    if missing:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise UserError(f"Triton, which builds this run's GPU kernels, needs {' and '.join(missing)}: install them "
                        f"(Debian/Ubuntu: apt-get install gcc python{version}-dev), or run in the project's Docker "
                        f"image")


def fp8_supported(device: torch.device) -> bool:
    """torch._scaled_mm's FP8 path needs compute capability 8.9+ (Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_forward_supported(device: torch.device) -> bool:
    """The MLP's FP8 products are Gluon kernels for Hopper's warpgroup MMA (model/mlp_kernels.py): compute
    capability 9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def use_device_paths(model, device: torch.device, fp8_head: bool = False, fp8_forward: bool = False,
                     fp8_backward: bool = False) -> None:
    """Pick the model's kernels for `device`. FlexAttention has no CPU backward, so on the CPU the same mask
    runs through SDPA (tests prove the two equal); CPUs without bf16 units emulate it slowly, so CPU math is fp32.
    The LM head's fused loss saves GPU memory and time; on the CPU plain F.cross_entropy is faster. It runs in
    FP8 when asked for and the GPU has it; so do the blocks' forward products (model/fp8.py), and with them the
    MLPs' backward products and the attentions' q, k, v projections' input gradients (ReLU2MLP, FP8QKV)."""
    cuda = device.type == "cuda"
    model.attention_backend = "flex" if cuda else "sdpa"
    if not cuda:
        model.compute_dtype = torch.float32
    model.head.fused = cuda
    model.head.fp8 = fp8_head and fp8_supported(device)
    # the FP8 operands' rows (D wide) and the products' outputs must be 16-byte aligned (TMA, cuBLAS)
    c = model.config
    fp8_fits = c.model_dim % 16 == 0 and (c.num_heads * c.head_dim) % 16 == 0
    for block in model.blocks:
        for part in (block.attn, block.mlp):
            if part is not None:
                part.fp8 = fp8_forward and fp8_fits and fp8_forward_supported(device)
        for part in (block.attn, block.mlp):
            if part is not None:
                part.fp8_backward = part.fp8 and fp8_backward


def setup(device_flag: str) -> Runtime:
    """Read torchrun's environment (absent: one process) and join the process group.

    NCCL on CUDA, gloo on CPU, so the same code runs on a GPU box and in CPU CI.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = choose_device(device_flag, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return Runtime(rank, world_size, device)


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


def all_ranks_sum(value: float, rt: Runtime) -> float:
    """Sum a Python number over ranks (identity on one process)."""
    if rt.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t)
    return t.item()


def agree_on_scales(model, rt: Runtime) -> None:
    """Every rank's MLPs and attentions take the largest of the ranks' last gradient amaxes, the history their FP8
    backward scales by (model/layers.py's ReLU2MLP and FP8QKV). Each rank records its own micro-batches', so without
    this the ranks' next scales would differ, and a checkpoint, which saves rank 0's, would resume the others at scales
    they never had. Called once a step, before the update: one all_reduce of a few floats."""
    amaxes = [part.grad_amax for b in model.blocks for part in (b.attn, b.mlp)
              if part is not None and part.fp8_backward]
    if rt.world_size == 1 or not amaxes:
        return
    stacked = torch.stack(amaxes)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    for amax, agreed in zip(amaxes, stacked):
        amax.copy_(agreed)


def broadcast_object(obj, rt: Runtime):
    """Rank 0's `obj` on every rank."""
    if rt.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
