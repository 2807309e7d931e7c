"""The one door every call of the user's code goes through: rewards, tools and environments, each loaded from
`package.module:function` by `load_callable` and called inside `calling`, which also keeps its time limit.

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
import importlib
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from components import run_marker
from components.interruptions import StageInterrupted, progress, stop_requested


class UserCodeError(RuntimeError):
    """The user's function failed; the message names it and what it raised."""


def load_callable(name: str, builtins: Mapping[str, Callable[..., Any]], what: str) -> Callable[..., Any]:
    """A built-in by name, or `package.module:function` imported from the user's code (`what`: "reward", "tool",
    "environment", named in each refusal: KeyError, ImportError or AttributeError)."""
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise KeyError(f"unknown {what} {name!r}; built-ins are {sorted(builtins)}, or give package.module:function")
    module_name, attr = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} for {what} {name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AttributeError(f"{module_name!r} has no callable {attr!r} for {what} {name!r}")
    return fn


@contextlib.contextmanager
def calling(what: str, doing: str = "running", error: type[UserCodeError] = UserCodeError,
            timeout_s: float = 0.0) -> Iterator[None]:
    """Run the body as a call of the user's `what` (e.g. "reward 'pkg.mod:fn'", doing "scoring"); a failure is
    raised as `error` (a UserCodeError), and so is a body still running after `timeout_s` seconds (0: no limit):
    `{what} took longer than {timeout_s}s`, from a TimeoutError of the same text. The limit is a SIGALRM timer, so
    it holds in the main thread only (elsewhere the body runs unlimited)."""
    marker = run_marker.current()
    marker.write(user_code=what, user_code_doing=doing, progress=progress())
    expired: list[TimeoutError] = []
    try:
        with _time_limit(timeout_s, what, expired):
            yield
    except StageInterrupted:
        raise
    except BaseException as err:
        signum = stop_requested()
        if signum is not None:  # the stop arrived while the user's code ran; the code's reaction is not its fault
            raise StageInterrupted(signum) from err
        if expired and err is expired[0]:
            raise error(str(err)) from err
        text = str(err).splitlines()[0][:300] if str(err) else ""
        raise error(f"{what} raised {type(err).__name__}" + (f": {text}" if text else "")) from err
    finally:
        marker.write(user_code=None, user_code_doing=None, progress=None)


@contextlib.contextmanager
def _time_limit(seconds: float, what: str, expired: list[TimeoutError]) -> Iterator[None]:
    """Raise TimeoutError in the main thread after `seconds` (recorded in `expired`, so `calling` knows it as its
    own): user code that hangs must not stall training."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        expired.append(TimeoutError(f"{what} took longer than {seconds:g}s"))
        raise expired[-1]

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
