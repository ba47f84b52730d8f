"""The metadata dataclasses: vLLM's in-tree design's two, and this project's report."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerMetadata, ECCPUWorkerReport


def test_types_subclass_vllm_bases() -> None:
    assert issubclass(ECCPUConnectorMetadata, ECConnectorMetadata)
    assert issubclass(ECCPUWorkerMetadata, ECConnectorWorkerMetadata)


def test_fields_and_defaults_match_the_in_tree_design() -> None:
    """The in-tree design's fields come first with its types; additions have defaults."""
    fields = {f.name: f for f in dataclasses.fields(ECCPUConnectorMetadata)}
    assert list(fields) == ["saves", "loads", "step", "save_shapes", "runs", "identifiers"]
    assert fields["saves"].type == "dict[str, list[int]]"
    assert fields["loads"].type == "dict[str, tuple[int, list[int], tuple[int, int]]]"
    assert ECCPUConnectorMetadata({"a": [1]}, {}).step == 0
    worker_fields = {f.name: f for f in dataclasses.fields(ECCPUWorkerMetadata)}
    assert list(worker_fields) == ["completed_saves", "completed_loads"]
    assert worker_fields["completed_saves"].type == "list[str]"
    assert worker_fields["completed_loads"].type == "list[int]"
    meta = ECCPUConnectorMetadata()
    assert meta.saves == {} and meta.loads == {} and meta.runs == {}
    assert meta.identifiers == {}, "no salted keys: nothing to translate"
    report = ECCPUWorkerMetadata()
    assert report.completed_saves == [] and report.completed_loads == []


def test_instances_do_not_share_mutable_defaults() -> None:
    a, b = ECCPUConnectorMetadata(), ECCPUConnectorMetadata()
    a.saves["h"] = [1]
    a.loads["h"] = (0, [1], (1, 4))
    assert b.saves == {} and b.loads == {}
    x, y = ECCPUWorkerMetadata(), ECCPUWorkerMetadata()
    x.completed_saves.append("h")
    assert y.completed_saves == []


def test_loads_carry_transfer_id_blocks_and_shape() -> None:
    meta = ECCPUConnectorMetadata(saves={"a": [3, 4]}, loads={"b": (7, [0, 1, 2], (3, 64))})
    transfer_id, blocks, shape = meta.loads["b"]
    assert (transfer_id, blocks, shape) == (7, [0, 1, 2], (3, 64))
    assert meta.saves["a"] == [3, 4]


def test_metadata_round_trips_through_pickle() -> None:
    meta = ECCPUConnectorMetadata(
        saves={"a": [1, 2]}, loads={"b|salt:" + "0" * 32: (3, [5], (1, 8))}
    )
    meta.identifiers["b|salt:" + "0" * 32] = "b"
    assert pickle.loads(pickle.dumps(meta)) == meta
    report = ECCPUWorkerMetadata(["a"], [3, 3])
    assert pickle.loads(pickle.dumps(report)) == report
    full = ECCPUWorkerReport(
        ["a"],
        [3],
        progress=[(0, 4, 4)],
        save_acks=[(0, 4, "a")],
        failed_saves=[(0, 4, "b")],
        load_acks=[(0, 3)],
        fallbacks=[(0, "load")],
        stats={"bytes_loaded": 8.0},
    )
    assert pickle.loads(pickle.dumps(full)) == full


def test_aggregate_concatenates_and_returns_self() -> None:
    rank0 = ECCPUWorkerMetadata(completed_saves=["a"], completed_loads=[1, 2])
    rank1 = ECCPUWorkerMetadata(completed_saves=[], completed_loads=[1, 2])
    rank2 = ECCPUWorkerMetadata(completed_saves=["b"], completed_loads=[2])
    result = rank0.aggregate(rank1).aggregate(rank2)
    assert result is rank0
    assert isinstance(result, ECCPUWorkerMetadata)
    assert result.completed_saves == ["a", "b"]
    assert result.completed_loads == [1, 2, 1, 2, 2]
    assert rank1.completed_loads == [1, 2]


def test_report_aggregate_concatenates_every_list_and_sums_stats() -> None:
    rank0 = ECCPUWorkerReport(
        ["a"], [1], progress=[(0, 5, 5)], save_acks=[(0, 5, "a")], load_acks=[(0, 1)]
    )
    rank0.stats = {"bytes_loaded": 8.0}
    rank1 = ECCPUWorkerReport(
        [], [1], progress=[(1, 5, 4)], load_acks=[(1, 1)], fallbacks=[(1, "load")]
    )
    rank1.stats = {"bytes_loaded": 8.0, "load_copy_seconds": 0.5}
    rank1.failed_saves.append((1, 5, "x"))
    merged = rank0.aggregate(rank1).aggregate(ECCPUWorkerMetadata(["c"], [2]))
    assert merged is rank0 and isinstance(merged, ECCPUWorkerReport)
    assert merged.progress == [(0, 5, 5), (1, 5, 4)]
    assert merged.save_acks == [(0, 5, "a")] and merged.failed_saves == [(1, 5, "x")]
    assert merged.load_acks == [(0, 1), (1, 1)] and merged.fallbacks == [(1, "load")]
    assert merged.completed_saves == ["a", "c"] and merged.completed_loads == [1, 1, 2]
    assert merged.stats == {"bytes_loaded": 16.0, "load_copy_seconds": 0.5}


class _Foreign(ECConnectorWorkerMetadata):
    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        return self


def test_aggregate_with_another_type_raises_type_error() -> None:
    with pytest.raises(
        TypeError, match=r"can only aggregate another ECCPUWorkerMetadata.*_Foreign"
    ):
        ECCPUWorkerMetadata().aggregate(_Foreign())
