"""Several processes: the distributed context, launch, collectives and DDP helpers (`distributed`), and FSDP2
sharding and its checkpoints (`fsdp`). One process never needs anything here beyond `DistContext()`."""
