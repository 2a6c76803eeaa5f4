"""The sections of `qkv bench`, one module each, registered in qkv.bench."""
