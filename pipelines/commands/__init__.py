"""The `grpo-pipeline` subcommands, one module per group; pipelines/cli.py imports only the one that runs."""
