"""Decoders and their checkpoints: the book's GPT (GPT-2), the Llama family with Qwen2/Qwen3,
Hugging Face folder loading and saving (qkv.models.hf.checkpoint).

Import the submodules directly; this package imports nothing so they stay independent.
"""
