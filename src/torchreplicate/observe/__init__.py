"""Read-only views of the steps: the timeline recorder, ``trace()``, ``log_summary()``, ``verify_replicas()``."""
