"""``FeatureMethod``: a method of a class on the reading path that lives in the module of
its optional feature, which loads the first time the method is looked up."""

import importlib
from typing import Optional


class FeatureMethod:
    """``name = FeatureMethod(module, attr)``: the function ``attr`` (default: ``name``) of
    ``module``, or the function ``name`` of its class ``attr``, bound like a method of the
    class that names it."""

    def __init__(self, module: str, attr: Optional[str] = None) -> None:
        self.module, self.attr = module, attr

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner: type):
        found = getattr(importlib.import_module(self.module), self.attr or self.name)
        if isinstance(found, type):
            found = getattr(found, self.name)
        return found if obj is None else found.__get__(obj, owner)


__all__ = ["FeatureMethod"]
