"""Hugging Face folders and files from anywhere: config.json + safetensors + tokenizer.json in and
out, untrusted files read under bounds, tokenizers guarded, packaged files (SmolLM2, MiniLM, GPT-2 ranks)."""
