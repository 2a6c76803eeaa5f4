"""How a recorded or explained object shows itself in Jupyter, without importing its view.

Data classes (a `Trace`, a `ScoreAttribution`) answer `_repr_html_` through `html_view`; the
modules that draw them (qkv.trace.render) register one function per class with
`register_html_view`. `import qkv.trace` imports those renderers, so every class that can be
recorded has its view registered before a notebook displays it. The arrows point one way:
render -> explain -> record, and this registry imports nothing.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

HTML_VIEWS: dict[type, Callable[[Any], str]] = {}


def register_html_view(kind: type, view: Callable[[Any], str]) -> None:
    """Make `view(value)` the HTML Jupyter shows for a value of class `kind`."""
    HTML_VIEWS[kind] = view


def html_view(value: Any) -> str:
    """The registered view's HTML of `value`, or its escaped repr when no view is registered."""
    view = HTML_VIEWS.get(type(value))
    return view(value) if view is not None else f"<pre>{html.escape(repr(value))}</pre>"
