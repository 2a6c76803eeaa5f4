"""freeze_loaded_heap and thaw_loaded_heap: what is alive when a command has loaded its model
leaves the collector's sweeps, what is made after is still collected, and when the command ends
its caller's collector is as it was (a command run in-process)."""

from __future__ import annotations

import gc
import weakref

import pytest

from qkv.util.heap import freeze_loaded_heap, hold_collections, thaw_loaded_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


@pytest.fixture
def quiet():
    gc.disable()  # no automatic collection between the test's steps
    gc.unfreeze()  # nothing frozen by anyone before (the tests' starting point)
    yield
    gc.enable()
    thaw_loaded_heap()
    gc.unfreeze()  # the test process's heap as it was


def tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_the_living_leave_the_sweeps_until_the_command_ends(quiet) -> None:
    kept = Node()
    assert tracked(kept)
    assert freeze_loaded_heap() > 0
    assert not tracked(kept)  # no collection walks it now
    later = weakref.ref(Node())
    gc.collect()
    assert later() is None  # new garbage is still collected
    dropped = weakref.ref(kept)
    del kept  # a cycle that became garbage while frozen
    gc.collect()
    assert dropped() is not None  # frozen: not collected
    thaw_loaded_heap()
    gc.collect()
    assert dropped() is None  # given back to the collector: collected


def test_a_process_that_froze_its_own_heap_is_left_alone(quiet) -> None:
    own = Node()
    gc.freeze()
    fresh = Node()
    assert freeze_loaded_heap() > 0
    assert tracked(fresh)  # nothing more frozen (counts are not compared: frozen objects freed leave them)
    thaw_loaded_heap()
    assert gc.get_freeze_count() > 0 and not tracked(own)  # its own freeze kept


@pytest.fixture
def collecting():
    gc.enable()
    yield
    thaw_loaded_heap()
    gc.unfreeze()
    gc.enable()


def test_collections_held_while_loading_resume_once_the_heap_is_frozen(collecting) -> None:
    hold_collections()
    assert not gc.isenabled()  # start-up's imports and load run no automatic collection
    freeze_loaded_heap()
    assert gc.isenabled()  # what requests and decode steps make is collected again
    thaw_loaded_heap()
    assert gc.isenabled()


def test_a_command_that_fails_before_its_heap_is_frozen_resumes_collections(collecting) -> None:
    hold_collections()
    thaw_loaded_heap()  # the dispatcher's finally, the load having raised
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collecting) -> None:
    gc.disable()
    hold_collections()
    freeze_loaded_heap()
    thaw_loaded_heap()
    assert not gc.isenabled()  # theirs to turn on
