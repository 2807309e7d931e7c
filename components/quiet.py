"""Third-party libraries' telemetry off and their progress bars hidden, wherever the pipeline starts.

Set in the environment (only where the user has not chosen otherwise) by the `grpo-pipeline` command, every
stage command (`python -m components.stages.*`, which `dvc repro` runs on its own) and the served model, so
a run's log shows the pipeline's own lines, each with its rate and ETA, and nothing phones home.

Also the import-time noise of torchao (installed for `grpo.lora.quantize_base: nf4`), which transformers imports
whenever it is installed: that its compiled kernels do not match this torch build (NF4 uses its Python code), that
Triton is absent, and torch's deprecation of how it registers two enums. Only those messages are dropped, as the
package is imported; every other warning of those loggers still shows.
"""

from __future__ import annotations

import logging
import os

QUIET_DEFAULTS = {
    # telemetry
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    # progress bars of other programs (transformers' "Loading weights", "Writing model shards", the GGUF
    # de-quantisation; MLflow's "Downloading artifacts")
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # not "Creating initial MLflow database tables..." on every new store
    # offline by default: models and data come from local paths or packages
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def quiet_libraries() -> None:
    """Apply QUIET_DEFAULTS before the libraries are imported (they read them once, at import)."""
    for key, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)


IMPORT_NOISE = {
    "torchao": ("Failed to load ",),
    "torchao.kernel.intmm": ("Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


class _DropKnown(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def drop_optional_import_noise() -> None:
    """A filter on each logger of IMPORT_NOISE (idempotent)."""
    for name, fragments in IMPORT_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(fragments))
