"""On PYTHONPATH, makes this interpreter look like the GPU machine's image to the code it runs: MLflow, Prefect, DVC
and Great Expectations are not installed (imports fail; availability probes through `importlib.util.find_spec` and
`importlib.metadata` say absent, as transformers' and accelerate's do). tests/benchmarks/test_gpu_rows.py runs the
device plan under it, so a plan that needs one of them fails here, not in the one GPU call."""
import importlib.metadata as md
import importlib.util
import sys

BLOCK = {"mlflow", "prefect", "dvc", "great_expectations", "great-expectations", "mlflow-skinny"}
_find_spec, _version, _distribution = importlib.util.find_spec, md.version, md.distribution


def find_spec(name, package=None):
    return None if name.split(".")[0] in BLOCK else _find_spec(name, package)


def version(name):
    if name in BLOCK:
        raise md.PackageNotFoundError(name)
    return _version(name)


def distribution(name):
    if name in BLOCK:
        raise md.PackageNotFoundError(name)
    return _distribution(name)


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)
        return None


importlib.util.find_spec, md.version, md.distribution = find_spec, version, distribution
sys.meta_path.insert(0, _Block())
