"""Great Expectations imported with scipy.stats and altair deferred (components/runtime/gx_import.py): the
two load only when used, and an expectation that uses them still computes the right figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, cwd: Path = ROOT, extra_path: Path | None = None) -> dict:
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    prelude = f"import sys, json; sys.path[:0] = {path!r}\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={"GX_ANALYTICS_ENABLED": "false", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_deferred_module_runs_only_when_an_attribute_is_read(tmp_path):
    package = tmp_path / "toypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text("import builtins\nbuiltins.HEAVY_RUNS = getattr(builtins, 'HEAVY_RUNS', 0) + 1\n"
                                      "def answer():\n    return 42\n")
    got = run_python("""
        import builtins
        from components.runtime.gx_import import DeferredModule, defer
        defer("toypkg.heavy")
        import toypkg.heavy
        from toypkg import heavy
        import toypkg.heavy as alias
        bound = getattr(builtins, "HEAVY_RUNS", 0)  # three import statements, nothing run yet
        stand_in = isinstance(heavy, DeferredModule) and heavy is alias
        value = heavy.answer()  # the first attribute read imports it
        real = sys.modules["toypkg.heavy"]
        again = alias.answer() + real.answer()
        print(json.dumps({"bound": bound, "stand_in": stand_in, "value": value, "again": again,
                          "runs": builtins.HEAVY_RUNS, "real_is_module": not isinstance(real, DeferredModule),
                          "parent_attr_is_real": sys.modules["toypkg"].heavy is real}))
    """, extra_path=tmp_path)
    assert got == {"bound": 0, "stand_in": True, "value": 42, "again": 84, "runs": 1, "real_is_module": True,
                   "parent_attr_is_real": True}


def test_gx_imports_without_scipy_stats_and_altair_and_loads_them_for_the_kl_expectation():
    got = run_python("""
        from components.runtime.gx_import import great_expectations as gx
        import pandas as pd
        after_import = {m: m in sys.modules for m in ("scipy.stats._stats_py", "altair.vegalite")}
        ctx = gx.get_context(mode="ephemeral")
        frame = pd.DataFrame({"c": ["a", "b", "a", "b"]})
        batch = (ctx.data_sources.add_pandas("p").add_dataframe_asset("t")
                 .add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": frame}))
        result = batch.validate(gx.expectations.ExpectColumnKLDivergenceToBeLessThan(
            column="c", partition_object={"values": ["a", "b"], "weights": [0.25, 0.75]}, threshold=1.0))
        print(json.dumps({"after_import": after_import, "kl": result.result["observed_value"],
                          "stats_loaded": "scipy.stats._stats_py" in sys.modules}))
    """)
    assert got["after_import"] == {"scipy.stats._stats_py": False, "altair.vegalite": False}
    # KL(observed || expected) with observed (1/2, 1/2), expected (1/4, 3/4), by hand:
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438
    assert abs(got["kl"] - expected) < 1e-9 and got["stats_loaded"] is True
