"""A run's log shows the run: importing transformers with torchao installed adds nothing to stderr once the
library is imported (components/quiet.py, drop_optional_import_noise), while other warnings of those loggers still
show."""

import subprocess
import sys

import pytest


def test_torchao_import_noise_is_dropped_and_other_warnings_kept():
    pytest.importorskip("torchao")
    code = ("import logging, components, transformers.quantizers.quantizer_torchao\n"
            "logging.getLogger('torchao').warning('a real torchao warning')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "Failed to load" not in err and "Enum subclass" not in err and "triton" not in err, err
    assert "a real torchao warning" in err
