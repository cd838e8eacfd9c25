"""B_global held exactly: the checks every integration shares."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.integrations.common import check_global_batch, nearest_global_batches, options_with_cap


def test_global_batch_not_divisible_by_world_names_the_nearest_valid():
    with pytest.raises(ConfigError, match=r"global_batch 10 is not divisible by the world size 4: .* 8, 12$"):
        check_global_batch(10, 4)
    assert nearest_global_batches(10, 4) == (8, 12) and nearest_global_batches(3, 4) == (4, 4)
    assert check_global_batch(12, 4) == 12
    for bad in (0, -4, 2.0, True, "8"):
        with pytest.raises(ConfigError, match="must be a whole number >= 1"):
            check_global_batch(bad, 1)


def test_search_is_capped_at_the_per_process_batch():
    assert options_with_cap({}, 64, 4)["max_micro_batch"] == 16
    assert options_with_cap({"max_micro_batch": 8}, 64, 4)["max_micro_batch"] == 8
    assert options_with_cap({"max_micro_batch": None}, 64, 2)["max_micro_batch"] == 32
