"""Splitting nested batches into micro-batches and joining per-chunk results."""

import collections
import dataclasses

import pytest
import torch

from torchmem.batch.split import batch_size_of, concat_results, split_batch, split_sizes

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    ids: torch.Tensor
    mask: torch.Tensor
    name: str = "s"


def test_split_sizes_cover_the_batch_with_a_short_tail():
    assert split_sizes(10, 4) == [4, 4, 2]
    assert split_sizes(8, 8) == [8]
    assert split_sizes(3, 8) == [3]
    with pytest.raises(ValueError):
        split_sizes(4, 0)


def test_split_nested_batch_keeps_types_and_passes_other_leaves():
    pos = torch.arange(5).unsqueeze(0)  # [1, L]: broadcasts, not split
    batch = {
        "pair": Pair(torch.arange(10), torch.arange(10) * 2),
        "sample": Sample(torch.ones(10, 3), torch.zeros(10, 3)),
        "list": [torch.arange(10), "tag"],
        "pos": pos,
        "scale": torch.tensor(2.0),
        "names": ["a"] * 10,
    }
    assert batch_size_of(batch) == 10
    parts = split_batch(batch, [4, 4, 2])
    assert len(parts) == 3
    assert isinstance(parts[0]["pair"], Pair) and isinstance(parts[2]["sample"], Sample)
    assert parts[2]["pair"].x.tolist() == [8, 9]
    assert parts[1]["pair"].y.tolist() == [8, 10, 12, 14]
    assert parts[2]["sample"].ids.shape == (2, 3) and parts[2]["sample"].name == "s"
    assert parts[1]["list"][1] == "tag" and parts[1]["list"][0].tolist() == [4, 5, 6, 7]
    assert parts[0]["pos"] is pos and parts[0]["scale"].item() == 2.0
    assert parts[0]["names"] == ["a"] * 10  # lists of samples pass whole by default
    assert split_batch(batch, [4, 4, 2], split_lists=True)[2]["names"] == ["a", "a"]
    assert parts[0]["pair"].x.data_ptr() == batch["pair"].x.data_ptr()  # a view, no copy


def test_split_rejects_sizes_that_do_not_add_up_and_batches_without_tensors():
    with pytest.raises(ValueError, match="add up"):
        split_batch(torch.zeros(6), [4, 4])
    with pytest.raises(ValueError, match="batch size"):
        batch_size_of({"a": "text", "b": [1, 2]})


def test_split_then_concat_is_identity():
    batch = {"x": torch.randn(7, 2), "t": (torch.arange(7), [1, 2])}
    parts = split_batch(batch, [3, 3, 1])
    out = concat_results([{"x": p["x"] * 2, "ids": p["t"][0].tolist()} for p in parts])
    assert torch.equal(out["x"], batch["x"] * 2)
    assert out["ids"] == list(range(7))
    joined = concat_results([Pair(torch.ones(2), 1), Pair(torch.ones(1), 1)])
    assert isinstance(joined, Pair) and joined.x.shape == (3,) and joined.y == 1


def test_concat_refuses_scalars():
    with pytest.raises(TypeError, match="per sample"):
        concat_results([torch.tensor(1.0), torch.tensor(2.0)])
