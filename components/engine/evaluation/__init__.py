"""What "better" means: held-out evaluation during and after training (`heldout`), task metrics such as pass@k
(`task_metrics`), and the monitors that read a run's curves (`monitors`)."""
