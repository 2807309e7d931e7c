"""The fast path: a prompt-once, packed forward and a preallocated-cache decoder for the model families of families.py
(`fastlm`), with oneDNN matrix products (`matmul`) and a fused RMSNorm (`rmsnorm`) on the CPU. It checks itself
against the Hugging Face forward when built (log-probs, entropies and, in training mode, gradients) and stands
aside when anything fails; only the rollout engines (`../engines/`) import it, so the rest of the engine reads as plain
PyTorch."""
