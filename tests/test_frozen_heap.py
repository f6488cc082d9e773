"""The driver's loop runs with the heap it started with left out of full collections, and gives it back."""

from __future__ import annotations

import gc

import pytest

from pipelines.common import frozen_heap


def test_the_heap_is_frozen_inside_and_given_back_even_on_an_error():
    assert gc.get_freeze_count() == 0
    cycle: list = []
    cycle.append(cycle)  # garbage from before the loop: kept while frozen, collected once given back
    with pytest.raises(RuntimeError), frozen_heap():
        assert gc.get_freeze_count() > 0
        del cycle
        raise RuntimeError("the loop failed")
    assert gc.get_freeze_count() == 0
    assert gc.collect() >= 1


def test_what_was_there_before_is_out_of_the_collector_s_reach_inside():
    before = [1, 2]
    with frozen_heap():
        during = [3, 4]
        tracked = gc.get_objects()  # what a full collection walks
        assert not any(o is before for o in tracked) and any(o is during for o in tracked)
        del tracked
    assert any(o is before for o in gc.get_objects())
