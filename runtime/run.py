"""The run folder, the disk-space check, the message for a failed write, and the settings made before compiling."""
import errno
import os
import shutil
import time
import uuid
from pathlib import Path

from runtime import dist
from runtime.errors import UserError


def make_run_dir(log_dir: str, rt: dist.Runtime) -> Path:
    """A fresh folder under --log_dir, named alike on every rank, proven writable."""
    run_id = dist.broadcast_object(time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6], rt)
    run_dir = Path(log_dir) / run_id
    if rt.is_master:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write_probe"
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
        except OSError as e:
            shutil.rmtree(run_dir, ignore_errors=True)  # a refused run leaves no folder behind
            raise UserError(f"--log_dir={log_dir} is not writable ({e.strerror}); "
                            f"pass a folder you can write to, e.g. --log_dir=/tmp/logs") from None
    return run_dir


def check_disk_space(log_dir: str, needed_bytes: int, what: str) -> None:
    """Refuse a run whose --log_dir (maybe not made yet) has less free space than `what` needs."""
    existing = Path(log_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise UserError(f"--log_dir={log_dir} has {size(free)} free but {what} needs about {size(needed_bytes)}; "
                        f"free some space or pass another --log_dir")


# no room on the disk, in the quota, or under the file-size limit
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def write_failed(what: str, run_dir: Path, error: OSError, needed_bytes: int) -> UserError:
    """The UserError for a failed write of `what`: the cause, the space needed, and how to go on."""
    from runtime.checkpoint import list_checkpoints  # runtime.checkpoint imports this module

    room = f": it needs about {size(needed_bytes)} more in {run_dir}" if error.errno in NO_ROOM else ""
    if error.errno == errno.ENOSPC:
        room += f", which has {size(shutil.disk_usage(run_dir).free)} free"
    kept = (f"the earlier checkpoints in {run_dir} are intact: free space and resume from the newest with --resume "
            f"{run_dir}" if list_checkpoints(run_dir) else
            f"no checkpoint was written in {run_dir} yet: free space and start the run again")
    return UserError(f"writing {what} failed ({error.strerror}){room}; {kept}")


def size(n: float) -> str:
    """Bytes for a message, in GiB, MiB or KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# Else our kernels use Triton's launcher, built with a C compiler on first use. The compile workers read this
# variable at start; a torch.compile option does not reach them.
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def use_static_launcher() -> None:
    """Statically launch our Triton kernels in compiled graphs (unless set otherwise); call before compiling."""
    import torch._inductor.config as inductor_config

    os.environ.setdefault(STATIC_LAUNCH_ENV, "1")
    inductor_config.static_launch_user_defined_triton_kernels = os.environ[STATIC_LAUNCH_ENV] == "1"
