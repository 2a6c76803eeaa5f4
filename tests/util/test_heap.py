"""freeze_loaded_heap: what is alive when it runs leaves the collector's sweeps, and what is
made after it is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from qkv.util.heap import freeze_loaded_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


@pytest.fixture
def thawed():
    gc.disable()  # no automatic collection between the test's steps
    yield
    gc.enable()
    gc.unfreeze()  # the test process's heap as it was


def test_the_living_leave_the_sweeps_and_new_garbage_is_still_collected(thawed) -> None:
    kept = Node()
    assert any(o is kept for o in gc.get_objects())
    frozen = freeze_loaded_heap()
    assert frozen > 0  # (objects of it freed since leave the count: it can only fall)
    assert not any(o is kept for o in gc.get_objects())  # no collection walks it now
    later = weakref.ref(Node())
    gc.collect()
    assert later() is None  # new garbage is still collected
