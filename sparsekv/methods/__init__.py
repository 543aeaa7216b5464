"""Methods: one file each, registered by name. `get_method("oracle", budget=64)` builds one."""

from .base import (REGISTRY, CacheShape, LayerState, Method, check_options_used, get_method, method_names, options_for,
                   register)

__all__ = ["REGISTRY", "CacheShape", "LayerState", "Method", "check_options_used", "get_method", "method_names",
           "options_for", "register"]
