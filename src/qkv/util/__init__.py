"""Plumbing every part of qkv shares: atomic writes, cache integrity, progress bars, text files,
terminal-safe text, thread counts, models built without initialising their weights."""
