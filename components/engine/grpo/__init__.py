"""The algorithm and its step: advantages, losses and KL estimators (`objectives`), the batch a step samples
(`sampling`), the trajectory that carries it to the update (`trajectory`), the update itself (`update`), the policy
and its reference (`policy`), checkpointed training state (`train_state`) and the step's memory (`memory_estimate`,
`host_memory`). components/stages/grpo.py composes them into the training loop."""
