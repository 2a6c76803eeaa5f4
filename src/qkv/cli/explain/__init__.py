"""`qkv explain`: the book's walkthrough, a real model's trace, the anatomy of its keys and why a
query picks a key."""
