"""User errors: short messages that name the cause and the fix, never a bare traceback.

`ValueError` is what the config, data and schedule checks raise for inputs a user got wrong (STYLE.md:
ValueError for users, assert for our own invariants); `UserError` is for the rest (missing files, devices).
The entry points run through `exit_on_user_error`, which prints `error: <message>` and exits with status 2.
Set SPEEDRUN_TRACEBACK=1 to see the full traceback instead.
"""
import os
import sys

USER_ERROR_EXIT = 2  # argparse's convention for a usage error


class UserError(Exception):
    """A mistake the user can fix; the message says how."""


def exit_on_user_error(main, *args, **kwargs):
    """Run main(); turn UserError/ValueError into a one-line message and exit status 2."""
    try:
        return main(*args, **kwargs)
    except (UserError, ValueError) as e:
        if os.environ.get("SPEEDRUN_TRACEBACK") == "1":
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)
