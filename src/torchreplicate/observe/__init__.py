"""Observers of the steps: the timeline recorder, ``trace()``, ``log_summary()``, ``verify_replicas()``.

They change no gradient, parameter or step, but they are not free of
collectives: ``log_summary()`` all-reduces a row per rank every N steps,
``trace()`` runs a barrier and gathers the records to rank 0, and
``verify_replicas()`` all-gathers digests. Every rank must call them alike.
"""
