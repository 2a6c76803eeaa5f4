"""Checkpoint key maps: a checkpoint's tensor names <-> qkv's module names, every key accounted for
(the book's state dict, Hugging Face names, a SpecDecoder's names). A checkpoint key is a tensor's
name in a state dict; an attention key is a vector (qkv.attention)."""
