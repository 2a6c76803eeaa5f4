"""A loaded model's Python objects taken out of the garbage collector's sweeps, for one command.

Once a model is loaded the heap holds long-lived containers of hundreds of thousands of
entries (a GGUF vocabulary's token, score and type lists: 262,144 each for Gemma 3), and
every full collection of Python's cyclic garbage collector walks each entry again. While 8
clients streamed from `qkv serve` on Gemma 3 270M, the collector was 13% of the server's
samples (perf). `freeze_loaded_heap` moves every object tracked now into the permanent
generation (gc.freeze), so later collections look only at what requests and decode steps
make. It does not collect first: a full collection right after a load takes 87-90 ms
(SmolLM2, Gemma 3: 183,000 objects) before the first token and finds 0-10 objects.

Before that, a command that loads a model holds the collector off (`hold_collections`) while
it imports torch and loads: importing torch alone runs some 400 collections, three of them full,
0.18-0.21 s of a 1B file's 2.2 s to the first token (measured with gc.callbacks, issue 33),
and what is made then lives to the end of the command. Holding it is bounded: it lasts from
the command's start to `freeze_loaded_heap`, which resumes collections, or to the command's end.

What is frozen is never collected, and the heap is the caller's when a command runs
in-process (`qkv.cli.main.main([...])`, as the tests run it): `thaw_loaded_heap`, which the
CLI's dispatcher calls when a command ends, gives the frozen objects back to the collector,
unless the process had frozen objects of its own before (then nothing is frozen or thawed),
and resumes collections that `hold_collections` held.

Shape legend: none.
"""

from __future__ import annotations

import gc

_froze = False  # whether freeze_loaded_heap froze the heap and it is not thawed yet
_held = False  # whether hold_collections turned the collector off and it is not resumed yet


def hold_collections() -> None:
    """No automatic collection until the model is loaded (freeze_loaded_heap) or the command
    ends (thaw_loaded_heap); a collector the caller turned off stays theirs."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def _resume_collections() -> None:
    global _held
    if _held:
        gc.enable()
        _held = False


def freeze_loaded_heap() -> int:
    """Exempt every object tracked now from later collections (unless the process froze
    objects itself), and collect again from here on if hold_collections held it; how many are frozen."""
    global _froze
    if gc.get_freeze_count() == 0:
        gc.freeze()
        _froze = True
    _resume_collections()
    return gc.get_freeze_count()


def thaw_loaded_heap() -> None:
    """Give what freeze_loaded_heap froze back to the collector (nothing if it froze nothing),
    and resume collections hold_collections held."""
    global _froze
    if _froze:
        gc.unfreeze()
        _froze = False
    _resume_collections()
