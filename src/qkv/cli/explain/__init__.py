"""`qkv explain`: the book's walkthrough, a real model's trace, the anatomy of its keys and why a
query picks a key."""

from qkv.cli.explain.command import register  # qkv.cli.main registers every subcommand by its package's `register`

__all__ = ["register"]
