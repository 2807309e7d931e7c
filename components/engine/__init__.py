"""GRPO and SFT maths and mechanics, by role; no file layout, no MLflow. Floors, top to bottom (import-linter keeps
them): `grpo` (the algorithm and its step) over `evaluation` (what "better" means) and `parallel` (several
processes) over `generation` (every row a model writes: the service, its scoring, the plays, the rollout engines and
the fast path behind them, the row types) over `rewards` over `models` (building models, formatting prompts, the
optimizer)."""
