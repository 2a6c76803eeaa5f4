"""The batching engine: one thread decodes every running request together, with its prefix
cache, the KV memory check, prompt workers and incremental detokenizing."""
