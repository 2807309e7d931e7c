"""Building models and what every training shares: loading and seeding (`modeling`, `gguf_model`), prompt formatting
(`prompting`, `prompt_text`), adapters' precision (`lora_precision`), quantized loading (`quantize`), and the optimizer
and schedule (`optim`). Sampling and log-probs live in `components.engine.generation`."""
