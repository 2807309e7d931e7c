"""The environment protocol's former address, kept for user code written against it: the environments now live in
`components.engine.generation.environments` (with the generation service, its scoring and the engines)."""
