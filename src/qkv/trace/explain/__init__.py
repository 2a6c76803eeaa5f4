"""Explaining what was recorded: why a query picks a key (attribution), what patching a key or
value changes (patching), the sink, the anatomy of keys, what learned weights do (analysis)."""
