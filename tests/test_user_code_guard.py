"""The user-code door (components/user_code.py): one loader for `package.module:function` behind rewards, tools and
environments, and the time limit kept by the guard every call goes through."""

from __future__ import annotations

import ast
import signal
import time
from pathlib import Path

import pytest

from components.config import ConfigError
from components.engine.generation.environments.environment import load_environment_factory
from components.engine.generation.environments.tools import load_tools
from components.engine.rewards.rewards import RewardError, resolve_reward
from components.user_code import UserCodeError, calling, load_callable

ROOT = Path(__file__).resolve().parent.parent
LOADERS = ["components/engine/rewards/rewards.py", "components/engine/generation/environments/tools.py",
           "components/engine/generation/environments/environment.py", "components/tracking/model_card.py"]


def test_rewards_tools_and_environments_load_through_the_one_loader():
    """Each names the same function for the same path, and refuses a module that is not there in the loader's words;
    none of them imports a module by name itself."""
    assert resolve_reward("reward_fixtures:starts_with_one") is load_callable("reward_fixtures:starts_with_one", {},
                                                                               "reward")
    for refuse, what in ((lambda n: resolve_reward(n), "reward"), (lambda n: load_tools([n]), "tool"),
                         (lambda n: load_environment_factory(n), "environment")):
        with pytest.raises((ImportError, ConfigError)) as err:
            refuse("no_such_module_xyz:f")
        assert f"cannot import module 'no_such_module_xyz' for {what} 'no_such_module_xyz:f'" in str(err.value)
    for rel in LOADERS:
        calls = [ast.unparse(node.func) for node in ast.walk(ast.parse((ROOT / rel).read_text()))
                 if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")]
        assert calls == [], rel


def test_a_call_past_its_limit_raises_the_guards_error_naming_it():
    previous = signal.getsignal(signal.SIGALRM)
    started = time.perf_counter()
    with pytest.raises(RewardError) as err:
        with calling("reward 'pkg.slow:score'", "scoring", RewardError, timeout_s=0.2):
            time.sleep(5)
    assert time.perf_counter() - started < 2
    assert str(err.value) == "reward 'pkg.slow:score' took longer than 0.2s"
    assert isinstance(err.value.__cause__, TimeoutError)  # what a tool's caller shows the model
    assert signal.getsignal(signal.SIGALRM) == previous and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_within_its_limit_or_without_one_a_call_runs_and_its_own_timeout_is_its_failure():
    with calling("tool 'quick'", timeout_s=5):
        time.sleep(0.01)
    with calling("tool 'unlimited'"):
        time.sleep(0.01)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with pytest.raises(UserCodeError, match=r"^tool 'net' raised TimeoutError: read timed out$"):
        with calling("tool 'net'", timeout_s=5):
            raise TimeoutError("read timed out")  # the function's own timeout, not the guard's limit
