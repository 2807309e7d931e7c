"""Reward functions and their safety: built-in rewards and user functions combined into one weighted total
(`rewards`), answer extraction from free text (`extract`), and the subprocess sandbox with time and memory
limits for rewards that run model output (`sandbox`)."""
