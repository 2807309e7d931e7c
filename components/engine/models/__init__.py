"""Building models and reading them the plain way: loading and seeding (`modeling`, `gguf_model`), prompt
formatting (`prompting`), group sampling with the Hugging Face forward and per-token log-probs (`rollout`,
`logprobs`), and the optimizer and schedule every training uses (`optim`)."""
