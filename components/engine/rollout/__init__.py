"""The rollout door: one `RolloutEngine` protocol (`sample`, `logprobs`) between the algorithm and whatever generates.

Each engine is one module here; `choose.build_engine` decides which one runs, once, from config and device. Every
engine is tested token for token against the plain Hugging Face engine (tests/engine/rollout/).
"""
