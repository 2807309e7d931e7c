"""Tools and environments: GRPO over episodes in which the model acts, a tool or an environment answers, and the
episode is scored. The episode loop (`episodes.py`) runs the rollout door's `sample` turn by turn; engines never know
about tools."""
