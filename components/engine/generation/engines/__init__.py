"""The rollout door: one `RolloutEngine` protocol (`sample`, `logprobs`) between the algorithm and whatever generates.

Each engine is one module here and one entry of components/rollout_engines.py; `choose.build_engine` decides which
one runs, once, from the entries' settings and the device. Every engine is tested token for token against the plain
Hugging Face engine (tests/engine/generation/engines/).
"""
