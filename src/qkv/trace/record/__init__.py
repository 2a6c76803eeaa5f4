"""Recording: forward hooks on real calls (recorder), each attention type's steps re-done from
its own parts (adapters), the residual stream's sources, the KV cache while generating, JSON export."""
