"""Per-module state and hooks: what ``replicate()`` keeps for a module and does around its forward.

The registry (``replicate.state(module)``), the plan of what is replicated
and when to plan again, the forward hooks, uneven inputs (``Join``), nested
``replicate()`` and mixed precision. It builds a reducer (``reducer/``) for
each plan and hands it the backward.
"""
