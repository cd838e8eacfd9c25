"""gc_frozen: the collections a search makes walk only what is new, and nothing is lost after."""

from __future__ import annotations

import gc
import weakref

from microbatch.measure.device import Device, gc_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_collections_inside_freeze_what_they_leave_and_the_block_gives_all_back() -> None:
    assert gc.get_freeze_count() == 0
    dev = Device("cpu")
    with gc_frozen():
        before = gc.get_freeze_count()
        kept = [_Node() for _ in range(1000)]  # made inside the block, alive at the collection
        dead = weakref.ref(_Node())  # garbage in a cycle: the collection frees it
        dev.free()
        assert dead() is None
        assert gc.get_freeze_count() >= before + 1000  # the survivors are frozen: not walked again
        late = weakref.ref(kept[0])
        kept.clear()  # garbage now, but frozen: skipped until the block ends
        gc.collect()
        assert late() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert late() is None  # collected once the block gave the frozen objects back


def test_a_nested_block_does_not_unfreeze_the_outer_one() -> None:
    with gc_frozen():
        with gc_frozen():
            pass
        assert gc.get_freeze_count() > 0
        dev = Device("cpu")
        n = gc.get_freeze_count()
        x = [_Node() for _ in range(100)]
        dev.free()
        assert gc.get_freeze_count() >= n + 100
        del x
    assert gc.get_freeze_count() == 0


def test_outside_a_block_free_freezes_nothing() -> None:
    Device("cpu").free()
    assert gc.get_freeze_count() == 0
