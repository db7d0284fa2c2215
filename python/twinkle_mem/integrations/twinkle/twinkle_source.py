"""twinkle-kit's source read without importing it: the integrations' shared reader (``core/source.py``), by the
name the twinkle integration and its tests use."""
from ..core.source import (PackageSource, accepts, calls, calls_function, decorated, divides_then_computes,
                           enclosing_function, feature, has_param, reads, signature, strings)

TwinkleSource = PackageSource

__all__ = ["TwinkleSource", "accepts", "calls", "calls_function", "decorated", "divides_then_computes",
           "enclosing_function", "feature", "has_param", "reads", "signature", "strings"]
