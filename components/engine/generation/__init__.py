"""Generation in one room: every row a model writes, from the call to its scores.

Floors, top to bottom (import-linter keeps them, pyproject.toml):

- `scoring.py`: `score`, the one scoring entry beside the service, one column set for every reward.
- `service.py`: `Generation.run`, the one generation service every caller uses (training, SFT's stop check, the
  held-out probe and the evaluate stage, pass@k, the dry run); every row is an episode.
- `environments/`: how a row plays (a single turn, the user's tools or environment), tool calls, chat layout, the
  environment protocol users write against.
- `engines/`: the rollout door (`RolloutEngine`: `start`, `sample`, `logprobs`), one module per engine of
  components/rollout_engines.py, chosen once (`engines/choose.py`).
- `fast/`: the prompt-once forward and decoder behind the fast engines; only `engines/` imports it.
- `logprobs.py`: per-token log-probs of rows through the plain Hugging Face forward.
- `rollouts.py`: the row types every floor above computes on (`Rollouts`, `Episodes`, `Turn`).
"""
