"""`python -m components.runtime.launch STAGE [--params ...] [--set ...]`: the command dvc.yaml runs for each stage.

Runs the stage in the pipeline's warm stage server when one is serving (components/runtime/stage_server.py),
otherwise in this process, exactly as `python -m components.stages.<stage>` does. Kept free of heavy
imports so that handing over costs milliseconds.
"""

from __future__ import annotations

import importlib
import os
import sys

from components.runtime.stage_server import SERVER_ENV, STAGE_MODULES, run_remote


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
            return code
    return int(importlib.import_module(f"components.{STAGE_MODULES[stage]}").main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
