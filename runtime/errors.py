"""UserError: a flag, file, device or checkpoint the user got wrong, as one line naming the cause and the fix.
Any other exception is a bug and keeps its traceback (SPEEDRUN_TRACEBACK=1 shows a UserError's too)."""
import json
import os
import sys
import time
import traceback

USER_ERROR_EXIT = 2  # argparse's convention for a usage error
# a bad flag fails in every process: waiting lets torchrun stop the others, so it shows once per node
LATER_RANKS_WAIT_S = 3.0


class UserError(ValueError):
    """A mistake the user can fix; the message says how."""


def exit_on_user_error(main, *args, **kwargs):
    """Run main(); a UserError becomes `error: <message>` and exit status 2; torchrun is told of any failure."""
    try:
        return main(*args, **kwargs)
    except Exception as e:
        if isinstance(e, UserError) and os.environ.get("SPEEDRUN_TRACEBACK") != "1":
            if int(os.environ.get("LOCAL_RANK", "0")) > 0:
                time.sleep(LATER_RANKS_WAIT_S)
            sys.stderr.write(f"error: {e}\n")  # one write, so processes' messages never share a line
            sys.stderr.flush()
            tell_torchrun(f"error: {e}")
            sys.exit(USER_ERROR_EXIT)
        tell_torchrun(traceback.format_exc().rstrip())  # as torch's @record does
        raise


def tell_torchrun(message: str) -> None:
    """Write `message` to TORCHELASTIC_ERROR_FILE, as torch's ErrorHandler does, for torchrun's failure summary."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:  # not under torchrun
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:  # the message is on stderr already
        pass
