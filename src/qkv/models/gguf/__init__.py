"""GGUF files (llama.cpp's format): the bounded header reader, architectures, config from
metadata, block dequantizers (32-weight blocks and K-quants), stored blocks, the file's tokenizer."""
