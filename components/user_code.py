"""The one door every call of the user's code goes through: rewards, tools and environments.

Whatever the user's function raises, `SystemExit` and `KeyboardInterrupt` included, comes out as one
`UserCodeError` naming it (`reward 'pkg.mod:fn' raised SystemExit: 1`), which the caller handles by its
own rule (a skipped GRPO step, a stopped stage) and the stage CLI prints as one line. A stop signal that
arrives while the user's code runs (Ctrl-C, SIGTERM: components/interruptions.py) is not the user's: it
goes on as the interruption it is.

What no exception can report (the process ends inside the user's code: `os._exit`, a segfault, an abort
in a C extension, the out-of-memory killer) is written down before the call: the stage's note
(components/run_marker.py) says which function was running, and the stage's parent, seeing the process
gone, reports "the stage ended while reward 'X' was scoring (exit code N)". Cost: two in-place writes of one
page of the note per call (no rename, no flush), next to a reward that scores a whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from components import run_marker
from components.interruptions import StageInterrupted, progress, stop_requested


class UserCodeError(RuntimeError):
    """The user's function failed; the message names it and what it raised."""


@contextlib.contextmanager
def calling(what: str, doing: str = "running", error: type[UserCodeError] = UserCodeError) -> Iterator[None]:
    """Run the body as a call of the user's `what` (e.g. "reward 'pkg.mod:fn'", doing "scoring"); a failure is
    raised as `error` (a UserCodeError)."""
    marker = run_marker.current()
    marker.write(user_code=what, user_code_doing=doing, progress=progress())
    try:
        yield
    except StageInterrupted:
        raise
    except BaseException as err:
        signum = stop_requested()
        if signum is not None:  # the stop arrived while the user's code ran; the code's reaction is not its fault
            raise StageInterrupted(signum) from err
        text = str(err).splitlines()[0][:300] if str(err) else ""
        raise error(f"{what} raised {type(err).__name__}" + (f": {text}" if text else "")) from err
    finally:
        marker.write(user_code=None, user_code_doing=None, progress=None)
