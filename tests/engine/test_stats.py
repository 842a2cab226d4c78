"""EngineStats: typed attributes, with the old dict access still working."""

from __future__ import annotations

import pytest

from qworker.engine.stats import EngineStats


def test_item_access_and_get_read_the_attributes() -> None:
    stats = EngineStats(num_kv_blocks=64, kv_blocks_used=3, attention_backend="torch")
    assert stats["num_kv_blocks"] == stats.num_kv_blocks == 64
    assert stats.get("kv_blocks_used", 0) == 3
    assert stats.get("no_such_figure", 7) == 7
    assert "prefix_cache_hits" in stats and "nope" not in stats
    with pytest.raises(KeyError):
        stats["nope"]
    assert stats.as_dict()["attention_backend"] == "torch"
    assert list(stats) == list(stats.keys())
