"""The one private torch hook the reducer needs: an end-of-backward callback.

``torch.autograd`` has no public way to run code once the current
``backward()`` has finished all its work; DDP and FSDP2 use the same private
entry point. Keep every use of it here.

Checked on torch 2.13.0; the same entry point exists since torch 1.x.
"""

from __future__ import annotations

from typing import Callable

import torch


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when the autograd graph task now executing ends.

    Must be called from inside a backward pass (from a tensor or gradient
    hook). Called from a nested backward (reentrant activation checkpointing),
    the callback runs when that nested pass ends, which is why the reducer
    queues it from a hook on the forward outputs, in the outermost pass
    (see [Note: end of backward] in reducer.py).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)
