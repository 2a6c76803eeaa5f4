"""Evaluating a decoder on a text: perplexity with a sliding window (Hugging Face's strided
method) and in llama.cpp's chunks, so the numbers compare with theirs."""
