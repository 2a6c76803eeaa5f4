"""Rendering traces and explanations: terminal tables, PNG figures, self-contained HTML pages,
Jupyter's rich display. Views import the data classes; the data classes never import a view."""
