"""Methods: one file each, registered by name. `get_method("oracle", budget=64)` builds one."""

from .base import REGISTRY, CacheShape, LayerState, Method, get_method, method_names, register

__all__ = ["REGISTRY", "CacheShape", "LayerState", "Method", "get_method", "method_names", "register"]
