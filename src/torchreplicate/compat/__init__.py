"""DDP's face: what code written against ``DistributedDataParallel`` (or torch's own ``replicate``) meets.

DDP's constructor arguments mapped onto ``replicate()``'s options
(ddp_args.py), DDP's attributes and methods on a replicated module
(ddp_surface.py), ``model.module`` as DDP's inner module (view.py), and
loading a checkpoint saved from DDP (checkpoint.py). One reason to change:
DDP's releases. It sits between the entry point and the module state:
compat imports core, never the reverse.
"""
