"""Methods: one file each, registered by name. `get_method("oracle", budget=64)` builds one; `MethodOptions` carries
the options a run gives its methods."""

from .base import REGISTRY, CacheShape, LayerState, Method, get_method, method_names, register
from .options import MethodOptions

__all__ = ["REGISTRY", "CacheShape", "LayerState", "Method", "MethodOptions", "get_method", "method_names",
           "register"]
