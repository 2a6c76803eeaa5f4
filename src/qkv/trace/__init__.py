"""Tracing attention: record the named steps of real calls with forward hooks, check that
they reproduce the module's output, and render them (terminal, PNG, HTML)."""

from qkv.trace.recorder import LayerTrace, Trace, TraceMismatchError, attention_modules, trace

__all__ = ["LayerTrace", "Trace", "TraceMismatchError", "attention_modules", "trace"]
