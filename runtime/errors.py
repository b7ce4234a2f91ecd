"""User errors: short messages that name the cause and the fix, never a bare traceback.

`ValueError` is what the config, data and schedule checks raise for inputs a user got wrong (the project's rule:
ValueError for users, assert for our own invariants); `UserError` is for the rest (missing files, devices).
The entry points run through `exit_on_user_error`, which prints `error: <message>` and exits with status 2 (under
torchrun, once per node, not once per process, and again as the root cause in torchrun's failure summary).
Set SPEEDRUN_TRACEBACK=1 to see the full traceback instead.
"""
import json
import os
import sys
import time
import traceback

USER_ERROR_EXIT = 2  # argparse's convention for a usage error
# torchrun starts one process per GPU, and a mistake in the flags fails in all of them alike. The first process of
# each node reports at once; the others wait this long first. If the first failed too, torchrun has stopped them by
# then (it polls its workers every 0.1 s, then sends SIGTERM), so the message shows once, not once per GPU. An error
# that only a later process meets (its device, say) is still printed, this much later.
LATER_RANKS_WAIT_S = 3.0


class UserError(Exception):
    """A mistake the user can fix; the message says how."""


def exit_on_user_error(main, *args, **kwargs):
    """Run main(); turn UserError/ValueError into a one-line message and exit status 2. Under torchrun, the message,
    or any other exception's traceback, is also the root cause in the failure summary torchrun prints last."""
    try:
        return main(*args, **kwargs)
    except Exception as e:
        if isinstance(e, (UserError, ValueError)) and os.environ.get("SPEEDRUN_TRACEBACK") != "1":
            if int(os.environ.get("LOCAL_RANK", "0")) > 0:
                time.sleep(LATER_RANKS_WAIT_S)
            sys.stderr.write(f"error: {e}\n")  # one write: two processes' messages never share a line
            sys.stderr.flush()
            tell_torchrun(f"error: {e}")
            sys.exit(USER_ERROR_EXIT)
        tell_torchrun(traceback.format_exc().rstrip())  # a bug, or a traceback asked for: as torch's @record does
        raise


def tell_torchrun(message: str) -> None:
    """Give torchrun the message (or traceback) for the failure summary it prints last, below its own traceback.

    torchrun gives each process an error file (TORCHELASTIC_ERROR_FILE) and shows the first failed process's file as
    the summary's root cause. A process that left none got "traceback : To enable traceback see: <url>", and the line
    that names the fix stood 44 lines above the end (2 processes, torch 2.13). The file takes the form torch's own
    ErrorHandler.record_exception writes, without the traceback, which the summary would show in the message's place
    (ProcessFailure in torch/distributed/elastic/multiprocessing/errors reads it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:  # not under torchrun
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:  # the message is on stderr already; the summary then points to torch's docs, as before
        pass
