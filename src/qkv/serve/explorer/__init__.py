"""The live attention explorer: the page at / and the endpoints it posts to (trace, why)."""
