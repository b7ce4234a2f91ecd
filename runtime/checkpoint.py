"""Checkpoints: written atomically, found safely, refused when the math would change.

A checkpoint is one `torch.save` file `ckpt_<step>.pt` holding the model, optimizer, loader and RNG states,
the step and both configs. It is first written to a temporary name in the same folder and then renamed, so a
killed write leaves the previous checkpoint untouched and a half-written file is never taken for a
checkpoint (only names matching `ckpt_<digits>.pt` are ever loaded). Loading checks every record against the
CRC-32 that torch.save stored with it, so damaged bytes are refused, not trained on. The last `KEEP`
checkpoints are kept.
"""
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

from model.gpt import GPT, GPTConfig
from runtime.dist import use_device_paths
from runtime.errors import UserError

KEEP = 2  # the newest and one spare, in case the newest is damaged after its write
_NAME = re.compile(r"ckpt_(\d+)\.pt$")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:06d}.pt"


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` to `path` atomically, then prune older checkpoints in the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(path.parent)[:-KEEP]:
        old.unlink()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first."""
    found = [p for p in Path(run_dir).iterdir() if _NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(_NAME.fullmatch(p.name).group(1)))


def resolve(path: str, flag: str = "--resume") -> Path:
    """A checkpoint file, or a run folder's newest checkpoint. `flag` is the option the user passed `path` with
    (train_gpt2's --resume, sample.py's --checkpoint), so that the messages name it."""
    p = Path(path)
    if p.is_dir():
        found = list_checkpoints(p)
        if not found:
            raise UserError(f"{flag} {path}: the folder holds no checkpoint (ckpt_<step>.pt); "
                            f"runs write them when started with --checkpoint_every N")
        return found[-1]
    if not p.exists():
        raise UserError(f"{flag} {path}: no such file; pass a ckpt_<step>.pt file or the run folder "
                        f"under --log_dir that holds it")
    return p


def load_checkpoint(path: str, mmap: bool = False, verify: bool = True, flag: str = "--resume") -> dict:
    """The state saved by save_checkpoint, on the CPU, its bytes checked unless `verify` is False (the caller checked
    this file already); mmap=True reads tensors lazily (no copies when only the config is needed). Errors name
    `flag`, the option the user passed `path` with.

    Always the CPU: the model's and the optimizer's load_state_dict copy into buffers already on the device, and
    the RNG states must stay CPU byte tensors (mapped to a GPU, torch.set_rng_state refused them and a resume
    crashed after its warm-up). Mapping the file to the device would also hold a second copy of the weights and
    moments there while they are copied."""
    p = resolve(path, flag)
    if not p.name.startswith("ckpt_") and not zipfile.is_zipfile(p):  # a cut-off ckpt_ file is damaged, below
        raise UserError(f"{flag} {p}: not a checkpoint (a run writes them as ckpt_<step>.pt); pass one of those, or "
                        f"the run folder that holds them")
    try:
        # torch.save stores a CRC-32 of every record, but torch.load does not check them: a flipped bit inside a
        # tensor would load as a silently different weight. The check reads the file once more: 0.39 s per GiB
        # from the page cache on the 2-core development machine, against 0.64 s for the torch.load itself
        # (bench/results/cpu_timings_2core.json).
        if verify:
            with zipfile.ZipFile(p) as archive:
                damaged = archive.testzip()
            if damaged is not None:
                raise zipfile.BadZipFile(f"{damaged} does not match its CRC-32")
        state = torch.load(p, map_location="cpu", weights_only=False, mmap=mmap)
    # damaged bytes surface as whichever error the zip reader or the unpickler meets first
    except (RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        earlier = f"an earlier ckpt_<step>.pt in {p.parent}"
        fix = f"resume from {earlier}" if flag == "--resume" else f"pass {earlier} to {flag}"
        raise UserError(f"{flag} {p}: the checkpoint is truncated or corrupt ({type(e).__name__}); {fix}") from None
    missing = {"model", "optimizer", "loader", "step", "config"} - set(state)
    if missing:
        raise UserError(f"{flag} {p}: not a training checkpoint (missing {sorted(missing)})")
    return state


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# The fix for a checkpoint that another version of this code wrote: resume or read it with that version
OTHER_VERSION_FIX = "check out the git_commit on the versions line of its run folder's log.txt"


def config_diff(saved: dict, current: dict, ignore: set[str], path: str) -> list[str]:
    """Fields (outside `ignore`) whose values differ, as 'name: saved -> current'. A UserError when the two do not
    have the same fields: another version of the code wrote the checkpoint, and a field it lacks has no value that
    this code could be told to match."""
    lacks, unknown = sorted(set(current) - set(saved) - ignore), sorted(set(saved) - set(current) - ignore)
    if lacks or unknown:
        found = "; ".join(f"{what} {', '.join(names)}" for what, names in (("lacks", lacks), ("has unknown", unknown))
                          if names)
        raise UserError(f"--resume {path}: the checkpoint was written by another gpt-speedrun version (its config "
                        f"{found}); resume it with that version: {OTHER_VERSION_FIX}")
    return [f"{n}: {saved[n]!r} -> {current[n]!r}" for n in sorted(set(current) - ignore) if saved[n] != current[n]]


def load_model(path: str, device: torch.device) -> tuple[GPT, dict]:
    """The trained GPT from a checkpoint (eval mode, kernels chosen for `device`) and the training config it
    was trained with, for sampling and evaluation; both take it as --checkpoint, which the errors name."""
    flag = "--checkpoint"
    state = load_checkpoint(path, mmap=True, flag=flag)  # lazily: only the weights are read
    try:
        model = GPT(GPTConfig(**state["model_config"])).to(device)
        model.load_state_dict(state["model"])
    except (TypeError, RuntimeError) as e:  # unknown config fields; missing, extra or reshaped weights
        first = str(e).strip().splitlines()[0]
        raise UserError(f"{flag} {path}: the checkpoint's model does not fit this version of the code ({first}); it "
                        f"was written by another gpt-speedrun version: {OTHER_VERSION_FIX} to sample or evaluate "
                        f"it") from None
    use_device_paths(model, device)
    return model.eval(), state["config"]
