"""`grpo-pipeline run --dry-run`: validates and runs one rollout + one loss, writes nothing."""

import re

from conftest import BIN, ROOT, copy_committed_project, run


def test_dry_run_writes_nothing_and_reports_one_rollout(tmp_path):
    repo = copy_committed_project(tmp_path / "repo")
    before = (repo / "params.yaml").read_text()
    proc = run([str(BIN / "grpo-pipeline"), "run", "--dry-run", "--set", "grpo.prompts_per_step=4",
                "--set", "task.n_train=100", "--set", "task.n_sft=50", "--set", "task.n_heldout=50"], repo)
    assert re.search(r"one rollout of 32 completions, reward mean \d\.\d{3}, loss [+-]\d\.\d{4}", proc.stdout)
    assert (repo / "params.yaml").read_text() == before
    for produced in ("data/prepared", "models", "metrics", "mlflow.db", "dvc.lock"):
        assert not (repo / produced).exists(), produced


def test_dry_run_refuses_bad_config_naming_the_key(tmp_path):
    repo = copy_committed_project(tmp_path / "repo")
    proc = run([str(BIN / "grpo-pipeline"), "run", "--dry-run", "--set", "grpo.group_size=1"], repo, check=False)
    assert proc.returncode == 2 and "error: grpo.group_size: must be >= 2" in proc.stdout


def test_dry_run_says_why_a_reward_is_missing_instead_of_nan(tmp_path):
    """A reward that scores nothing (None for every completion): the dry run says no reward scored them and which
    rewards returned None, never `reward mean nan`."""
    repo = copy_committed_project(tmp_path / "repo")
    proc = run([str(BIN / "grpo-pipeline"), "run", "--dry-run", "--set", "grpo.prompts_per_step=4",
                "--set", "task.n_train=100", "--set", "task.n_sft=50", "--set", "task.n_heldout=50",
                "--set", "grpo.rewards=[{name: 'reward_fixtures:abstains', weight: 1.0}]"], repo,
               env={"PYTHONPATH": str(ROOT / "tests")})
    assert "nan" not in proc.stdout, proc.stdout[-2000:]
    ending = r"\d+ episodes? (ended with EOS|cut at the token budget \(grpo.max_completion_length\))"
    assert re.search(r"one rollout of 32 completions, no reward mean \(32 of 32 completions have no reward: every "
                     rf"reward \(reward_fixtures:abstains\) returned None for them: {ending}(, {ending})*\), loss",
                     proc.stdout), proc.stdout[-2000:]


def test_the_missing_rewards_of_cut_episodes_are_explained_by_how_each_ended():
    """Episodes the pipeline cut at a limit, or that ended without a reward of the environment's own, are counted
    by how they ended; the mean is over the completions some reward scored."""
    from components.engine.generation.environments.episodes import Episodes
    from components.engine.generation.rollouts import Episode
    from components.engine.rewards.rewards import RewardResult
    from pipelines.dry_run import reward_summary

    def episode(cut=None, reward=None):
        return Episode((), (), (), (), 1, cut is None, reward=reward, cut=cut)

    episodes = [episode("tokens"), episode("tokens"), episode("turns"), episode(reward=1.0), episode(),
                episode("environment error: ValueError: no such board")]
    endings = [Episodes.ending(None, e) for e in episodes]
    env = [None, None, None, 1.0, None, None]
    rewards = RewardResult(total=[0.0, 0.0, 0.0, 0.5, 0.0, 0.0], components={"environment_reward": env},
                           scores=[env], weights=[0.5])
    summary = reward_summary(rewards, endings)
    assert summary["reward_mean"] == 0.5 and summary["unscored"] == 5
    assert summary["reward_said"] == (
        "reward mean 0.500 over the 1 scored (5 of 6 completions have no reward: every reward (environment_reward) "
        "returned None for them: 2 episodes cut at the token budget (grpo.max_completion_length) before the "
        "environment ended them, 1 episode cut at grpo.episode.max_turns before the environment ended them, "
        "1 episode ended by the environment without a reward of its own, 1 episode ended by an environment error)")
    whole = RewardResult(total=[1.0, 0.0], components={"r": [1.0, 0.0]}, scores=[[1.0, 0.0]], weights=[1.0])
    assert reward_summary(whole, None)["reward_said"] == "reward mean 0.500"
