"""GRPO and SFT maths and mechanics, by role; no file layout, no MLflow. Floors, top to bottom (import-linter keeps
them): `grpo` (the algorithm and its step) over `evaluation` (what "better" means) over `fast`, `rewards` and
`parallel` (independent of each other) over `models` (building models, formatting prompts, plain sampling and
log-probs). The fast path (`fast`) is imported by `grpo.policy` alone."""
