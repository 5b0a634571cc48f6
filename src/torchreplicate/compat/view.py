"""``model.module`` on a replicated model: the same model, seen as DDP's inner module.

[Note: model.module]
DDP code reads ``ddp.module`` to reach the model (``ddp.module.state_dict()``,
``ddp.module.config``), and unwrapping helpers follow ``.module`` until there
is none: accelerate's ``extract_model_from_parallel(model, recursive=True)``,
transformers' ``unwrap_model`` without accelerate, ``while hasattr(m,
"module"): m = m.module``. ``replicate()`` does not wrap, so nothing else
holds the weights; and were ``model.module`` the model itself, those loops
would never end (a ``RecursionError``, or a hang).

So ``model.module`` is a *view* of the model: an object of a subclass of the
model's own class (its ``__name__`` too) that shares the model's
``__dict__``. It has the same parameters, buffers, submodules, hooks and
attributes (a change made through either is made to both), the same
``state_dict`` keys as DDP's ``ddp.module.state_dict()``, and a forward
through it is the model's replicated forward (the hooks are shared). Like
DDP's inner module it has none of DDP's attributes, and so no ``module``
(unless the model has its own): unwrapping ends there. ``replicate.state``
of the view is the model's state, so ``replicate(model.module)`` is refused
as a second ``replicate()``; ``view.to(...)`` re-plans as ``model.to(...)``
does, and ``copy.deepcopy(view)`` or a pickle gives a plain copy, as for the
model. ``model.module is model.module`` holds while the view is referenced
(the registry keeps it weakly); ``model.module is model`` does not.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional, cast

from torch import nn

from torchreplicate.core.plan import ReplansOnConversion
from torchreplicate.core.registry import find_view, record_view


class _View(ReplansOnConversion):
    # What a view adds to the model's own class. Its one slot holds the model
    # weakly: the view's __dict__ is the model's, so nothing of its own can live there.
    __slots__ = ("_model_ref",)
    _model_ref: weakref.ref[nn.Module]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy(model.module), torch.save(model.module): the model's own plain copy
        model = self._model_ref()
        if model is None:
            raise RuntimeError("model.module: the replicated model this view belonged to was garbage-collected")
        return model.__reduce_ex__(protocol)


@functools.lru_cache(maxsize=None)
def _view_class(cls: type) -> type:
    # cls: the model's original class (replicate()'s subclass's original_class)
    # __qualname__: type(model.module) prints as the view's class, and pickling the class by reference fails
    namespace = {"__module__": cls.__module__, "__qualname__": f"Replicate{cls.__qualname__}View", "__slots__": ()}
    return type(cls.__name__, (_View, cls), namespace)


def view_of(module: nn.Module) -> nn.Module:
    """``module.module`` for a replicated ``module``: its view ([Note: model.module]).

    Args:
        module: a module ``replicate()`` was applied to.

    Returns:
        The view, the same one while it is referenced.
    """
    found: Optional[nn.Module] = find_view(module)
    if found is not None:
        return found
    original: type = getattr(type(module), "original_class", type(module))
    view: Any = object.__new__(_view_class(original))
    view.__dict__ = module.__dict__  # one namespace: the same parameters, submodules, hooks, attributes
    view._model_ref = weakref.ref(module)
    record_view(module, view)
    return cast(nn.Module, view)
