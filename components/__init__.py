"""grpo-pipeline's library: configs, data, engine, stages (no Prefect imports)."""

from components.quiet import drop_optional_import_noise

drop_optional_import_noise()
