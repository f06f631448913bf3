import gc
import weakref
from collections.abc import Iterator

import pytest

from swarm.models.heap import freeze_loaded


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


def test_freeze_loaded_collects_garbage_first_then_keeps_the_living_out_of_later_collections() -> None:
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    living = [_Node() for _ in range(1000)]
    before = gc.get_freeze_count()

    frozen = freeze_loaded()

    assert gone() is None  # loading's cyclic temporaries are not frozen for good
    assert frozen >= before + len(living)
    # what it returns is the count it made; since then frozen objects may only have been freed (refcounts,
    # other threads of the test session), never more frozen
    assert gc.get_freeze_count() <= frozen


def test_objects_made_after_the_freeze_are_still_collected() -> None:
    freeze_loaded()
    later = _Node()
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None
