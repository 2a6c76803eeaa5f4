"""Tracing attention: record the named steps of real calls with forward hooks, check that
they reproduce the module's output, and render them (terminal, PNG, HTML).

`qkv.trace(model, inputs, layer=, head=, query=)` is the entry point. This package is
itself callable with the same arguments, because `qkv.trace` names both the package and
the function (`import qkv.trace.render.html` binds the package to `qkv.trace`).
"""

import sys
import types

from qkv.trace.record.recorder import LayerTrace, Trace, TraceMismatchError, attention_modules, trace
from qkv.trace.render import attribution_view, notebook  # noqa: F401  (register the Jupyter views: qkv.trace.record.views)


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs) -> Trace:
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["LayerTrace", "Trace", "TraceMismatchError", "attention_modules", "trace"]
