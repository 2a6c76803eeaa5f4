"""Model configs: one frozen dataclass per family with presets (GPT-2, Llama, Qwen), typed reads
of config.json, RoPE settings, the family registry, and the layer/decoder descriptions families fill in."""
