"""Checkpoints: `ckpt_<step>.pt` files of tensors and plain values, loaded as data (weights-only, so a pickle that
would run code is refused) with CRCs checked. Written to a temporary name, then renamed, so a killed write leaves the
previous checkpoint intact and is never loaded."""
import argparse
import dataclasses
import fcntl
import os
import pickle
import re
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from model.config import GPTConfig
from model.gpt import GPT
from runtime.backend import build_model
from runtime.errors import UserError, exit_on_user_error
from runtime.run import write_failed

KEEP = 2  # the newest and a spare, in case the newest is damaged
_NAME = re.compile(r"ckpt_(\d+)\.pt$")
_TEMP = re.compile(r"\.ckpt_\d+\.pt\.tmp\d+$")  # save_checkpoint's temporary files
# a writer locks its file just after creating it: a younger one may be unlocked yet alive
STALE_AFTER_S = 5


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:06d}.pt"


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` to `path` atomically, then prune older checkpoints."""
    path = Path(path)
    _write_atomically(path, state)
    for old in list_checkpoints(path.parent)[:-KEEP]:
        old.unlink()


def _write_atomically(path: Path, state: dict) -> None:
    """torch.save to a temporary file beside `path`, locked while written, then renamed to `path` and fsynced."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # no locks on this filesystem: write anyway
                pass
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # still locked, so a live writer's file never looks stale
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename durable
    finally:
        os.close(dir_fd)


def save_run(run_dir: Path, step: int, train_time_ms: float, model, optimizer, loader, config, model_config) -> Path:
    """Checkpoint the run after update `step`. A failed write (a full disk) raises a UserError giving the space
    needed; the earlier checkpoints stay intact."""
    path = checkpoint_path(run_dir, step)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict(),
             "rng": rng_state(), "step": step, "train_time_ms": train_time_ms,
             "config": dataclasses.asdict(config), "model_config": dataclasses.asdict(model_config)}
    try:
        save_checkpoint(path, state)
    except (OSError, RuntimeError) as e:
        cause = _os_error(e)
        if cause is None:
            raise
        raise write_failed(f"checkpoint {path}", run_dir, cause, _tensor_bytes(state)) from None
    return path


def _os_error(error: Exception) -> OSError | None:
    """The OSError behind a failed torch.save: the error, or the one torch's zip writer re-raised as a RuntimeError."""
    if isinstance(error, RuntimeError) and "inline_container.cc" in str(error):
        error = error.__context__
    return error if isinstance(error, OSError) else None


def _tensor_bytes(state) -> int:
    """The bytes of the tensors in a nested state, about its checkpoint's size."""
    if isinstance(state, torch.Tensor):
        return state.nbytes
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return sum(_tensor_bytes(item) for item in items)


def space_needed(config: GPTConfig) -> int:
    """The most bytes a run's checkpoints take at once: KEEP + 1, each at most four fp32 copies of the parameters."""
    with torch.device("meta"):  # shapes without memory
        params = GPT(config).num_params()
    return 4 * 4 * params * (KEEP + 1)


def remove_stale_temps(log_dir: str, resume: str = "") -> int:
    """Remove killed writes' temporary files from --log_dir's run folders and the resumed checkpoint's folder;
    returns the bytes freed. A file is stale when no process holds its lock."""
    temps = set(Path(log_dir).glob("*/.ckpt_*.pt.tmp*"))
    if resume:
        temps |= set(resolve(resume).parent.glob(".ckpt_*.pt.tmp*"))
    return sum(_remove_if_stale(tmp) for tmp in temps if _TEMP.fullmatch(tmp.name))


def _remove_if_stale(tmp: Path) -> int:
    """Remove `tmp` if no process holds its lock; returns the bytes freed."""
    try:
        stat = tmp.stat()
        if time.time() - stat.st_mtime < STALE_AFTER_S:
            return 0
        fd = os.open(tmp, os.O_RDWR)  # over NFS, an exclusive lock needs write access
    except OSError:  # removed meanwhile, or not ours
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tmp.unlink()
        return stat.st_size
    except OSError:  # a live writer, no locks, or not ours: leave it
        return 0
    finally:
        os.close(fd)


def restore(path: str, model, optimizer, loader) -> tuple[int, float]:
    """Load a checkpoint into the run's objects (its CRCs were checked with its config); returns (step, train ms)."""
    state = load_checkpoint(path, mmap=True, verify=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    set_rng_state(state["rng"])
    return state["step"], state["train_time_ms"]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first."""
    found = [p for p in Path(run_dir).iterdir() if _NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(_NAME.fullmatch(p.name).group(1)))


def resolve(path: str, flag: str = "--resume") -> Path:
    """A checkpoint file, or a run folder's newest; the errors name `flag`, the option that passed `path`."""
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
    """The state saved by save_checkpoint, on the CPU (load_state_dict copies it to the device; RNG states must stay
    CPU tensors); CRCs checked unless `verify` is False; errors name `flag`."""
    p = resolve(path, flag)
    if not p.name.startswith("ckpt_") and not zipfile.is_zipfile(p):  # a cut-off ckpt_ file is reported below
        raise UserError(f"{flag} {p}: not a checkpoint (a run writes them as ckpt_<step>.pt); pass one of those, or "
                        f"the run folder that holds them")
    try:
        if verify:
            _check_crcs(p)
        state = torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    # damaged bytes raise whatever the zip reader or unpickler meets first
    except (RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        # CRCs intact: the file was written that way, not damaged
        if isinstance(e, pickle.UnpicklingError) and str(e).startswith("Weights only load failed"):
            raise UserError(_refusal(flag, p, str(e))) from None
        earlier = f"an earlier ckpt_<step>.pt in {p.parent}"
        fix = f"resume from {earlier}" if flag == "--resume" else f"pass {earlier} to {flag}"
        raise UserError(f"{flag} {p}: the checkpoint is truncated or corrupt ({type(e).__name__}); {fix}") from None
    missing = {"model", "optimizer", "loader", "step", "config"} - (set(state) if isinstance(state, dict) else set())
    if missing:
        raise UserError(f"{flag} {p}: not a training checkpoint (missing {sorted(missing)})")
    return state


def _check_crcs(p: Path) -> None:
    """A BadZipFile unless every record matches its stored CRC-32: torch.load does not check them, and a flipped bit
    would load as a silently different weight."""
    with zipfile.ZipFile(p) as archive:
        damaged = archive.testzip()
    if damaged is not None:
        raise zipfile.BadZipFile(f"{damaged} does not match its CRC-32")


def _refusal(flag: str, p: Path, message: str) -> str:
    """The refusal of a checkpoint whose pickle would import or call what torch's `message` names."""
    named = re.search(r"GLOBAL (\S+)", message)
    return (f"{flag} {p}: refused: loading it would run {named.group(1) if named else 'code'}, and a checkpoint holds "
            f"only tensors and plain values; if you wrote this file and trust it, convert it once with "
            f"`python -m runtime.checkpoint --convert {p}` (which runs it)")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


OTHER_VERSION_FIX = "check out the git_commit on the versions line of its run folder's log.txt"


def saved_config(path: str) -> dict:
    """The TrainConfig fields (a dict) a checkpoint was trained with, read lazily."""
    return load_checkpoint(path, mmap=True)["config"]


def load_model(path: str, device: torch.device, kernels: str = "auto",
               attention_forward: str = "bf16") -> tuple[GPT, dict]:
    """The GPT from a checkpoint (eval mode, built for `device`) and its training config; errors name --checkpoint."""
    flag = "--checkpoint"
    state = load_checkpoint(path, mmap=True, flag=flag)
    try:
        model, _ = build_model(GPTConfig(**state["model_config"]), device, kernels, fp8=False,
                               attention_forward=attention_forward)
        model.load_state_dict(state["model"])
    except (TypeError, RuntimeError) as e:  # unknown config fields; missing, extra or reshaped weights
        first = str(e).strip().splitlines()[0]
        raise UserError(f"{flag} {path}: the checkpoint's model does not fit this version of the code ({first}); it "
                        f"was written by another gpt-speedrun version: {OTHER_VERSION_FIX} to sample or evaluate "
                        f"it") from None
    return model.eval(), state["config"]


def convert(path: str) -> Path:
    """Rewrite in place, as data, a checkpoint the weights-only load refuses: numpy values become tensors or numbers,
    paths strings; anything else is refused. Runs its pickle: only for a trusted file."""
    p = resolve(path, "--convert")
    try:
        _check_crcs(p)
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"--convert {p}: not a checkpoint, or a damaged one ({e})") from None
    state = torch.load(p, map_location="cpu", weights_only=False)
    _write_atomically(p, _as_data(state, "the checkpoint", p))
    return p


def _as_data(value, where: str, p: Path):
    """`value` in the types the weights-only unpickler accepts; `where` names it in the refusal."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str, torch.Tensor, torch.nn.Parameter):
        return value
    if kind in (dict, OrderedDict):
        return kind((_as_data(k, where, p), _as_data(v, f"{where}[{k!r}]", p)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(_as_data(v, f"{where}[{i}]", p) for i, v in enumerate(value))
    if isinstance(value, np.ndarray) and value.dtype != object:
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise UserError(f"--convert {p}: {where} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint cannot "
                    f"hold as data; this file was not written by gpt-speedrun")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.checkpoint",
                                     description="Rewrite a trusted checkpoint that loading refuses as data.")
    parser.add_argument("--convert", required=True, metavar="CKPT",
                        help="a ckpt_<step>.pt file or the run folder holding it; its pickle runs: only a file you "
                             "wrote yourself")
    args = parser.parse_args(argv)
    print(f"converted {convert(args.convert)}: it loads as data now")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
