"""Splitting a batch into micro-batches and concatenating per-chunk results.

A "batch" is whatever a data loader yields: a tensor, or a nest of dicts (any
Mapping, e.g. Hugging Face's BatchEncoding), lists, tuples, namedtuples and
dataclasses whose tensor leaves share a leading batch dimension. Splitting walks
the nest once and rebuilds the same container types around tensor views
(`Tensor.split` copies nothing), so a step function sees the structure it was
written for.

Note [What gets split]
A tensor leaf is split when its first dimension equals the batch size; every
other leaf (0-d tensors, tensors with another leading size such as a [1, L]
position table that broadcasts, strings, numbers, None) is passed unchanged to
every micro-batch. The batch size is the leading size of the first tensor leaf
met in a depth-first walk, unless the caller gives it. Lists and tuples are
containers, not samples: a list of B strings is passed through whole. Callers
who need per-sample lists split should make them tensors or give
`split_lists=True`.

Note [Concatenating results]
`concat_results` is the inverse for outputs of a function run chunk by chunk
(oom_retry's split mode): tensors are joined along dim 0, tuples/namedtuples/
dicts/dataclasses element by element, and lists, which a function over a batch
returns one item per sample, are joined end to end. A 0-d tensor cannot be
joined (a sum or a mean over the chunk would be silently wrong), so it raises a
TypeError asking for per-sample values. Non-tensor leaves that are equal in
every chunk are kept once; unequal ones become a list.
"""

import dataclasses
from collections.abc import Mapping

import torch

__all__ = ["batch_size_of", "split_batch", "split_sizes", "balanced_sizes", "concat_results"]


def _is_namedtuple(obj):
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj):
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _children(obj):
    """The direct sub-values of a container, or None for a leaf."""
    if isinstance(obj, Mapping):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if _is_dataclass_instance(obj):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def batch_size_of(batch):
    """The leading dimension of the first tensor leaf of `batch` (depth first).

    Raises ValueError when the batch holds no tensor with at least one dimension,
    because then there is nothing to split: give the size explicitly."""
    stack = [batch]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0:
                return obj.shape[0]
            continue
        children = _children(obj)
        if children:
            stack.extend(reversed(children))
    raise ValueError(
        f"cannot find the batch size of a {type(batch).__name__}: it holds no tensor with a batch "
        f"dimension; pass batch_size=... explicitly or make the samples tensors"
    )


def split_sizes(total, micro):
    """[micro, micro, ..., rest]: chunk sizes covering `total` samples."""
    if total < 0 or micro < 1:
        raise ValueError(f"split_sizes: need total >= 0 and micro >= 1, got total={total}, micro={micro}")
    sizes = [micro] * (total // micro)
    if total % micro:
        sizes.append(total % micro)
    return sizes


def balanced_sizes(total, micro):
    """The fewest chunks of at most `micro` samples covering `total`, as even as
    they come: [22, 21, 21] for 64 at 22, [16, 16, 16, 16] for 64 at 19. The
    same count of micro-steps as split_sizes, with no short tail and the
    smallest largest chunk (the least memory) that count allows."""
    if total < 0 or micro < 1:
        raise ValueError(f"balanced_sizes: need total >= 0 and micro >= 1, got total={total}, micro={micro}")
    if total == 0:
        return []
    count = -(-total // micro)
    small, extra = divmod(total, count)
    return [small + 1] * extra + [small] * (count - extra)


def _rebuild(template, values):
    """A container of the same type as `template` holding `values` in order."""
    if isinstance(template, Mapping):
        items = dict(zip(template.keys(), values))
        try:
            return type(template)(items)
        except Exception:
            return items
    if _is_namedtuple(template):
        return type(template)(*values)
    if isinstance(template, tuple):
        return tuple(values)
    if isinstance(template, list):
        return list(values)
    if _is_dataclass_instance(template):
        fields = dataclasses.fields(template)
        init_fields = {f.name: v for f, v in zip(fields, values) if f.init}
        try:
            rebuilt = type(template)(**init_fields)
        except Exception:
            rebuilt = object.__new__(type(template))
        for f, v in zip(fields, values):
            object.__setattr__(rebuilt, f.name, v)
        return rebuilt
    raise TypeError(f"cannot rebuild a {type(template).__name__}")


def split_batch(batch, sizes, batch_size=None, split_lists=False):
    """Splits `batch` into len(sizes) micro-batches of the given sizes.

    Tensor leaves whose first dimension equals the batch size become views
    (no copy); other leaves are shared by every micro-batch (Note [What gets
    split]). With split_lists=True, lists of exactly batch-size items are
    sliced too (e.g. a list of prompt strings)."""
    total = batch_size_of(batch) if batch_size is None else batch_size
    if sum(sizes) != total:
        raise ValueError(f"split_batch: sizes {sizes} add up to {sum(sizes)}, not the batch size {total}")
    if len(sizes) == 1:
        return [batch]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)

    def split(obj):
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0 and obj.shape[0] == total:
                return list(obj.split(sizes, dim=0))
            return [obj] * len(sizes)
        if split_lists and isinstance(obj, list) and len(obj) == total and not _is_namedtuple(obj):
            return [obj[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
        children = _children(obj)
        if children is None:
            return [obj] * len(sizes)
        parts = [split(child) for child in children]
        return [_rebuild(obj, [part[i] for part in parts]) for i in range(len(sizes))]

    return split(batch)


def concat_results(results):
    """Joins the outputs of a function run on consecutive chunks of a batch
    (Note [Concatenating results])."""
    if not results:
        raise ValueError("concat_results: no results to join")
    first = results[0]
    if len(results) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise TypeError(
                "oom_retry cannot join 0-d tensors from different chunks (a sum or mean would be wrong); "
                "return one value per sample (shape [n, ...]) or use mode='batch_size'"
            )
        return torch.cat(results, dim=0)
    if isinstance(first, list):
        joined = []
        for part in results:
            joined.extend(part)
        return joined
    if first is None:
        return None
    children = _children(first)
    if children is not None:
        if isinstance(first, Mapping):
            keys = list(first.keys())
            columns = [[part[k] for part in results] for k in keys]
        else:
            columns = list(zip(*[_children(part) for part in results]))
        return _rebuild(first, [concat_results(list(column)) for column in columns])
    if all(part == first for part in results[1:]):
        return first
    return list(results)
