"""A loaded model's Python objects taken out of the garbage collector's sweeps, for one command.

Once a model is loaded the heap holds long-lived containers of hundreds of thousands of
entries (a GGUF vocabulary's token, score and type lists: 262,144 each for Gemma 3), and
every full collection of Python's cyclic garbage collector walks each entry again. While 8
clients streamed from `qkv serve` on Gemma 3 270M, the collector was 13% of the server's
samples (perf). `freeze_loaded_heap` moves every object tracked now into the permanent
generation (gc.freeze), so later collections look only at what requests and decode steps
make. It does not collect first: a full collection right after a load takes 87-90 ms
(SmolLM2, Gemma 3: 183,000 objects) before the first token and finds 0-10 objects.

What is frozen is never collected, and the heap is the caller's when a command runs
in-process (`qkv.cli.main.main([...])`, as the tests run it): `thaw_loaded_heap`, which the
CLI's dispatcher calls when a command ends, gives the frozen objects back to the collector,
unless the process had frozen objects of its own before (then nothing is frozen or thawed).

Shape legend: none.
"""

from __future__ import annotations

import gc

_froze = False  # whether freeze_loaded_heap froze the heap and it is not thawed yet


def freeze_loaded_heap() -> int:
    """Exempt every object tracked now from later collections (unless the process froze
    objects itself); how many are frozen."""
    global _froze
    if gc.get_freeze_count() == 0:
        gc.freeze()
        _froze = True
    return gc.get_freeze_count()


def thaw_loaded_heap() -> None:
    """Give what freeze_loaded_heap froze back to the collector (nothing if it froze nothing)."""
    global _froze
    if _froze:
        gc.unfreeze()
        _froze = False
