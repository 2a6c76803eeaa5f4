"""`qkv serve`: an OpenAI-compatible HTTP API with continuous batching, and the live
attention explorer. app (routes), engine (batching over slot caches), schemas (request
checks, errors), metrics (Prometheus text), text (detokenizing), explorer (the page)."""
