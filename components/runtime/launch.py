"""`python -m components.runtime.launch STAGE [--params ...] [--set ...]`: the command dvc.yaml runs for each stage.

Runs the stage in the pipeline's warm stage server when one is serving (components/runtime/stage_server.py),
otherwise in this process, exactly as `python -m components.stages.<stage>` does. Kept free of heavy
imports so that handing over costs milliseconds.

A stage that the server saw die without a word (a signal, or an exit inside the user's code) is reported
here, in one line, from the note it left (components/run_marker.py); a stage killed by a signal ends this
process by the same signal, so DVC and the pipeline see the signal, not an exit code made of it.
"""

from __future__ import annotations

import importlib
import os
import resource
import signal
import sys

from components.run_marker import ended_text, marker_path, read_dead_note
from components.runtime.stage_client import run_remote
from components.runtime.stage_server import SERVER_ENV, STAGE_MODULES

ERROR_FILE_ENV = "GRPO_STAGE_ERROR_FILE"  # components/stages/cli.py's; not imported: it pulls in the config


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in STAGE_MODULES:
        print(f"usage: python -m components.runtime.launch {{{','.join(STAGE_MODULES)}}} [--params FILE] "
              "[--set KEY=VALUE]", file=sys.stderr)
        return 2
    stage, rest = args[0], args[1:]
    server = os.environ.get(SERVER_ENV)
    if server:
        code = run_remote(server, stage, rest)
        if code is not None:
            return report_silent_end(stage, code)
    return int(importlib.import_module(f"components.{STAGE_MODULES[stage]}").main(rest) or 0)


def report_silent_end(stage: str, code: int) -> int:
    """The stage's exit code, after saying in one line how it ended when it left its note behind (it died
    without running its `finally`); a signal is passed on as that signal."""
    note = read_dead_note(marker_path(stage)) if code != 0 else None
    if note is not None:
        text = f"{stage}: {ended_text(note, code)}"
        target = os.environ.get(ERROR_FILE_ENV)
        if target and not (os.path.exists(target) and os.path.getsize(target)):
            with open(target, "w", encoding="utf-8") as fh:
                fh.write(text)
        else:
            print(f"error: {text}", file=sys.stderr, flush=True)
        marker_path(stage).unlink(missing_ok=True)  # said: the rerun need not say it again
    if code < 0:
        end_by_signal(-code)
    return code


def end_by_signal(signum: int) -> None:
    """End this process by `signum` (no core file of its own), as the stage it ran ended."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if signum != signal.SIGKILL:
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to end the process: the shell's convention


if __name__ == "__main__":
    sys.exit(main())
