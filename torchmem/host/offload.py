"""torchmem.offload_activations: move saved activations to pinned host memory,
only as many as a byte budget needs, overlapped with compute.

    offload = torchmem.offload_activations(budget_bytes=6 << 30)
    for batch in loader:
        with offload:                       # forward: saved tensors may move out
            loss = model(batch).loss
        loss.backward()                     # they come back ahead of use
        opt.step(); opt.zero_grad()

Note [What moves]
The first step inside the context moves every eligible saved tensor (on a
device in `devices`, at least `min_bytes`, not a parameter, dense) and
measures them: their sizes in the order forward saved them. From then on a
plan moves only enough to keep at most `budget_bytes` of them on the device,
choosing by size x lifetime: a tensor saved early in forward is used late in
backward, so it occupies the device longest (lifetime = its distance from the
end of forward). Largest and longest-lived go first. A step whose saved tensors
differ from the measurement (another shape) is followed by a new plan; tensors
past the measured list are moved, which is always safe. budget_bytes=None moves
every eligible tensor.

Note [Shared storages]
One tensor is often saved by several ops (Llama's RMSNorm saves its fp32 input
for pow and again for mul; `x * x` saves x twice), and views of one storage
too. Moving each save on its own copied the same bytes over PCIe twice, and
moving one save of a storage that a kept save holds frees nothing: on the H200
17% of the bytes Llama moved with a quarter of its activations moved, and 39%
with half, were such saves (bench/offload_timeline.py; BENCHMARKS.md, Host
memory and offload). So every later save of a storage saved earlier in the same forward
follows the first save's decision:
- a kept storage: the save stays (moving it would free nothing);
- a moved storage: the same elements (offset, shape, strides, dtype, conj/neg
  flags) not written to since (the version) share its host copy, one copy
  each way, unpacked as often as saved; another view moves on its own.
It is the same storage only if the storage object is the one saved first:
storage objects live exactly as long as their memory, so an address freed
(a `.data` swap, a storage resized to 0) and handed to another tensor does
not match. A later save counts 0 bytes toward the budget: the plan sees each
storage once, at its first save, whose size grows by each other view's bytes
(up to the storage's), since keeping that save keeps them all; the sizes it
measures do not depend on what moved.

Note [Offload streams]
Device to host: the pack hook makes a side stream wait for the current one
(the tensor was produced there), copies into a pool block on the side stream
and record_stream()s the device tensor on it, so the caching allocator does not
reuse its memory until the copy finished; compute goes on meanwhile. Host to
device, on a second side stream (after each tensor's device-to-host event),
in reverse save order, which is the order backward uses them, but only for
tensors whose copy out already finished. Moving a GiB or more takes longer
than forward, so the last-saved tensors, which backward needs first, are still
on their way out when backward starts; queued behind them, every fetch waited
for all of the copying out, and the step took the sum of both directions
(1.63x the unbudgeted step with a quarter moved, H200). Fetching what is out
already keeps both directions busy. A tensor backward needs before it was
fetched is fetched at once on a third, high-priority stream, not queued
behind prefetches. The end of forward starts the first fetches; from then on
each unpack, of a kept tensor or of an offloaded one, may start more:
- Fetching stays memory-neutral: the bytes fetched may pass the bytes of
  this step's saved tensors that were freed since (kept tensors whose last
  reference autograd dropped, each storage once, and fetched tensors once
  used) by at most the floor, and the floor, the first `prefetch` tensors'
  worth, is only for the tensors backward needs next, in order. So the saved
  activations on the device never exceed those kept at the end of forward
  plus the floor. Frees are seen through weakref finalizers, not the device's
  statistics. Two simpler rules do not hold the bound: counting the tensors
  backward unpacked overstates the room (a tensor still referenced elsewhere
  is unpacked without being freed: on the H200 the half-moved peak rose above
  no offload), and the device's allocated level at the end of forward lets
  the floor go to tensors fetched out of order (GPT-2's everything-moved peak
  rose from 6.5 to 9.6 GiB), while reading `torch.cuda.memory_allocated`
  (every statistic, flattened in Python) at each unpack slows a host-bound
  step.
- It still starts as early as that allows. The longest-lived tensors, which
  are the ones moved, are used at the very end of backward. Fetching only
  `prefetch` of them ahead of use leaves their copies no time to hide behind
  compute: the step was 1.65x the unbudgeted one with a quarter of the
  activations moved, on the H200 (the current figures: BENCHMARKS.md, Host
  memory and offload).
Each unpack makes the current stream wait for its tensor's event and
record_stream()s the new device tensor on the current stream, so nothing is
read before it arrived or freed while still in use. Host blocks return to the pinned pool when autograd drops the
saved tensor, and the pool reuses them only after both copies finished
(torchmem/host/pool.py). Streams are created once per offloader: fresh streams each
step would make the caching allocator grow pools.

Note [Saved versions]
While saved-tensor hooks are active PyTorch does not check that a saved
tensor was left unwritten until backward: without hooks, writing in place to
a tensor autograd saved raises "one of the variables needed for gradient
computation has been modified by an inplace operation"; with hooks that hand
the tensor back, backward silently uses the new values (gradients off by 15
in a CPU test's case). So every save records the tensor's
version: a save that stays is packed as (tensor, version), a moved one keeps
a weak reference to its tensor and the version, and unpacking a save whose
tensor is at another version raises autograd's error. A moved save whose
tensor is gone by backward cannot be checked (its version went with it; a
strong reference would keep the device memory the move freed), so a write
made before that tensor died still goes unseen there.

Note [Offload copies]
Each move is a handful of CUDA calls (a stream wait, a pool block, a copy, a
recordStream, an event). From Python they cost about 200 us of host time per
moved tensor in each hook on the H200 host (about ten torch calls), and
Llama's step there is host-bound: the GPU ends forward and backward as soon as
the host has queued them, so that time was most of the step's excess with a
quarter of the activations moved (BENCHMARKS.md, Host memory and offload). In a CUDA build
with a CUDA host pool the hooks make one call into torchmem._C instead
(csrc/bindings/offload_copies_cuda.cpp: the same steps in the same order).
It copies bytes, so conj and neg views and tensor subclasses take torch's
calls, whose copy_ resolves them.
TORCHMEM_OFFLOAD_COPIES=python keeps torch's calls (to compare the two).

Values are copied bit for bit, strides included, so gradients are identical to
a run without offload (tests/test_offload.py, tests/gpu/test_gpu_host.py).
"""

import os
import time
import weakref

import torch

from torchmem import host as pinned_host
from torchmem._loader import extension

__all__ = ["OffloadActivations", "OffloadedTensor", "offload_activations"]


def offload_activations(budget_bytes=None, **kwargs):
    """An OffloadActivations context (see its docstring and this module's notes)."""
    return OffloadActivations(budget_bytes, **kwargs)


class OffloadedTensor:
    """One saved tensor living in host memory: what the pack hook returns for a moved
    tensor, and what an OffloadActivations observer is handed. Read-only for users:
    shape, stride, dtype, device and nbytes describe the tensor; d2h_event and h2d_event
    are the CUDA events after its copy out and its latest fetch (None on the CPU)."""

    __slots__ = ("host", "host_base", "shape", "stride", "dtype", "device", "step", "nbytes", "d2h_event", "h2d_event",
                 "fetched", "used", "unpacks", "source", "version", "__weakref__")


class _SavedStorage:
    """A storage's first save in one forward (Note [Shared storages])."""

    __slots__ = ("storage", "signature", "moved_as", "index", "nbytes")

    def __init__(self, storage, signature, moved_as, index):
        self.storage = weakref.ref(storage)  # dies with the memory: a reused address does not match
        self.signature = signature
        self.moved_as = None if moved_as is None else weakref.ref(moved_as)  # None: kept
        self.index = index  # in the step's sizes, which count every view of the storage there
        self.nbytes = storage.nbytes()


class _Step:
    """The offloaded tensors of one forward (weakrefs, in save order) and its backward's
    fetch accounting (Note [Offload streams])."""

    __slots__ = ("refs", "ready", "end", "cursor", "fetched", "freed", "floor", "live", "watched",
                 "freed_seen", "looked_at", "saved_storages", "__weakref__")

    def __init__(self):
        self.refs = []
        self.ready = 0     # refs[:ready] finished their copy to the host
        self.end = None    # refs[end:] are all fetched or used (set when backward begins)
        self.cursor = None  # refs[cursor:end] are all fetched or used too (None: = end)
        self.fetched = 0   # bytes of offloaded tensors fetched back
        self.freed = 0     # bytes of this step's saved tensors (kept, or fetched back) freed since
        self.floor = 0     # bytes the next-needed fetches may take beyond `freed`
        self.live = {}     # storage of a kept tensor -> [tracked tensors alive on it, its bytes]
        self.watched = {}  # id(weakref) -> (weakref, storage key of a kept tensor or None, bytes fetched)
        self.freed_seen = -1  # `freed` at the last look ahead
        self.looked_at = 0.0  # time.perf_counter() of the last look ahead
        self.saved_storages = {}  # storage address -> _SavedStorage

    def has_room(self, h, allowance):
        """Whether fetching `h` now keeps memory neutral (Note [Offload streams]); `allowance`
        is the floor for the tensors backward needs next, 0 for the others."""
        return self.fetched + h.nbytes <= self.freed + allowance

    def track_kept(self, t, storage, key):
        """Counts `t`'s storage (at address `key`) as freed once every kept tensor tracked on it
        is gone."""
        if not key:
            return  # no real storage (a fake or functional tensor while tracing): it makes no room
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, storage.nbytes()]
        else:
            entry[0] += 1
        self._watch(t, key, 0)

    def track_fetched(self, t, nbytes):
        self._watch(t, None, nbytes)  # a fetched tensor has a storage of its own: no count needed

    def _watch(self, t, key, nbytes):
        # A weakref with a callback, kept here until it fires: a quarter of the cost of
        # weakref.finalize, which a step pays for each of its hundreds of saved tensors.
        ref = weakref.ref(t, self._gone)
        self.watched[id(ref)] = (ref, key, nbytes)

    def _gone(self, ref):
        item = self.watched.pop(id(ref), None)
        if item is None:
            return
        _, key, nbytes = item
        if key is None:
            self.freed += nbytes
            return
        entry = self.live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self.live[key]
                self.freed += entry[1]

    def worth_a_look(self):
        """Whether fetching ahead could start something now: room was freed since the last
        look, or copies out may have finished (polled at most every 100 us: a CUDA event
        query per unpack of a kept tensor was host time a CPU-bound step cannot spare)."""
        if self.freed != self.freed_seen:
            return True
        return self.ready < len(self.refs) and time.perf_counter() - self.looked_at >= 1e-4


def _done(h):
    """Nothing left to fetch for this offloaded tensor (gone, used, or fetched already)."""
    return h is None or h.used or h.fetched is not None


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that move activations to a pinned host pool.

    Arguments:
      budget_bytes  most bytes of eligible saved tensors kept on the device;
                    None moves them all (Note [What moves]).
      min_bytes     smaller tensors stay (a copy has a fixed cost) (1 MiB); empty
                    ones always stay.
      pool          a torchmem.host.HostPool (default: torchmem.host.default_pool()).
      prefetch      offloaded tensors fetched ahead in backward (3).
      devices       device types whose tensors may move (("cuda",); tests use
                    ("cpu",) to run the logic on CPU tensors).
      observer      None, or observer(what, handle, stream), told of each moved
                    tensor (an OffloadedTensor) for instrumentation
                    (bench/offload_timeline.py): "out" after its copy to the host
                    was queued on `stream`; "in" or "urgent" after its fetch was
                    queued on `stream` (urgent: backward was already waiting for
                    it); "need" when backward asks for it; "used" when backward
                    has it. `stream` is None except for "out", "in" and "urgent"
                    on CUDA tensors. It runs inside autograd's hooks: keep it short.

    Use it as a context around forward, once per step (also around several
    micro-steps). After a step, `last_step` holds saved_bytes, offloaded_bytes,
    offloaded_count, kept_bytes and shared_saves (later saves of a storage saved
    before in the step: Note [Shared storages]); `plan` the indices moved.
    """

    def __init__(self, budget_bytes=None, *, min_bytes=1 << 20, pool=None, prefetch=3, devices=("cuda",),
                 observer=None):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"offload_activations: budget_bytes must be None or an int >= 0, got {budget_bytes!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"offload_activations: prefetch must be an int >= 0, got {prefetch!r}")
        super().__init__(self._pack, self._unpack)
        self.budget_bytes = budget_bytes
        self.min_bytes = int(min_bytes)
        self.prefetch = prefetch
        self.devices = tuple(devices)
        self.observer = observer
        self._cuda_only = self.devices == ("cuda",)
        self._pool = pool
        self.measured = None   # sizes of the eligible saved tensors of the measured step
        self.plan = None       # indices to move; None until measured (move all)
        self.last_step = None
        self._streams = {}     # device -> (d2h, h2d)
        self._native = _UNRESOLVED  # the host pool's torchmem._C holder if the one-call copies apply, else None
        self._backward = None  # the step whose backward kept tensors' unpacks count toward
        self._begin_step()

    # ------------------------------------------------------------- planning
    def set_budget(self, budget_bytes):
        """Changes the budget; the next step follows a new plan."""
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"offload_activations: budget_bytes must be None or an int >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        if self.measured is not None:
            self.plan = plan_offload(self.measured, budget_bytes)

    def _begin_step(self):
        self._sizes = []
        self._offloaded = _Step()  # this forward's OffloadedTensor
        self._moved_bytes = 0  # copied to the host (later views of a moved storage too)
        self._kept_bytes = 0   # the saves kept on the device, each storage once

    def __enter__(self):
        self._begin_step()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self.last_step = {
            "saved_bytes": sum(self._sizes),
            "offloaded_bytes": self._moved_bytes,
            "offloaded_count": len(self._offloaded.refs),
            "kept_bytes": self._kept_bytes,
            "shared_saves": self._sizes.count(0),  # Note [Shared storages]: a later save counts 0
        }
        if exc[0] is not None:
            return result  # (an OOM?) fetch nothing more; the graph is dropped
        if self._sizes != self.measured:
            self.measured = list(self._sizes)
            self.plan = plan_offload(self.measured, self.budget_bytes)
        # Backward starts after forward: fetch the last-saved tensors now.
        step = self._offloaded
        self._backward = step
        step.end, step.cursor = len(step.refs), None
        for ref in reversed(step.refs[-self.prefetch:] if self.prefetch else []):
            h = ref()
            if h is not None:
                step.floor += h.nbytes
        self._fetch_ahead(step)
        return result

    # ---------------------------------------------------------------- hooks
    def _movable_bytes(self, t):
        """The bytes of `t` if it may move, else None."""
        # Runs for every saved tensor of every step: cheapest tests first. isinstance(x,
        # Parameter) goes through Parameter's metaclass in Python (~10 us on a CPU VM), so only
        # leaves are asked: a Parameter is always a leaf, and activations never are.
        # On the H200 a Llama step saves 333 tensors, and their hooks' host time was most of the
        # step's excess over its PCIe bound (bench/offload_profile.py; BENCHMARKS.md, Host memory
        # and offload).
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or nbytes == 0:  # an empty tensor has nothing to move
            return None
        if not (t.is_cuda if self._cuda_only else t.device.type in self.devices):
            return None
        if t.layout != torch.strided or t.is_sparse or t.is_nested or t._is_zerotensor():
            return None  # a zero tensor (forward AD) stores nothing; a nested one has no one shape
        base = t._base if t._base is not None else t  # linear saves weight.t(), a view of the weight
        if base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter)):
            return None  # weights (frozen ones too) stay where the optimizer updates them
        if not t.is_contiguous():
            span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
            if span != t.numel():
                return None  # not dense, or overlapping: a flat copy would not hold it exactly
        return nbytes

    def _pack(self, t):
        nbytes = self._movable_bytes(t)
        if nbytes is None:
            return (t, t._version)  # stays (Note [Saved versions])
        step = self._offloaded
        if step.end is not None:
            # A forward after this step's backward began (several micro-steps in one context,
            # or a recompute): what the earlier backward freed is being allocated again, so it
            # is no longer room for fetches, and the next look starts from the newest save.
            step.freed = min(step.freed, step.fetched)
            step.end = step.cursor = None
        storage, key = _storage_of(t)
        signature = _signature(t)
        first = step.saved_storages.get(key) if key else None
        if first is not None and first.storage() is not storage:
            first = None  # another storage at a freed one's address
        index = len(self._sizes)
        self._sizes.append(0 if first is not None else nbytes)  # Note [Shared storages]: once a storage
        if first is not None:
            return self._pack_again(t, nbytes, storage, key, signature, first)
        if self.plan is not None and index < len(self.measured) and index not in self.plan:
            step.track_kept(t, storage, key)  # its free in backward makes room for a fetch
            self._kept_bytes += nbytes
            if key:
                step.saved_storages[key] = _SavedStorage(storage, signature, None, index)
            return (t, t._version)
        h = self._move(t, nbytes, step)
        if key:
            step.saved_storages[key] = _SavedStorage(storage, signature, h, index)
        return h

    def _pack_again(self, t, nbytes, storage, key, signature, first):
        """A later save of a storage this forward saved before: it follows the first save's
        decision (Note [Shared storages])."""
        if first.signature != signature:  # another view: its bytes count with the first save
            grown = min(self._sizes[first.index] + nbytes, first.nbytes) - self._sizes[first.index]
            self._sizes[first.index] += grown
            if first.moved_as is None:
                self._kept_bytes += grown
        if first.moved_as is None:
            self._offloaded.track_kept(t, storage, key)  # a kept storage: moving this save frees nothing
            return (t, t._version)
        moved_as = first.moved_as()
        if moved_as is not None and first.signature == signature:
            moved_as.unpacks += 1
            return moved_as
        return self._move(t, nbytes, self._offloaded)  # another view of a moved storage moves too

    def _move(self, t, nbytes, step):
        """Starts copying `t` to the host pool; returns its OffloadedTensor."""
        pool = self._host_pool()
        h = OffloadedTensor()
        h.shape, h.stride, h.dtype, h.device = t.shape, t.stride(), t.dtype, t.device
        h.step = step
        h.nbytes = nbytes
        h.fetched, h.h2d_event, h.used, h.unpacks = None, None, False, 1
        h.source, h.version = weakref.ref(t), t._version  # Note [Saved versions]
        if t.device.type == "cuda":
            d2h = self._streams_for(t.device)[0]
            # Note [Offload copies]: a plain dense tensor's bytes are its values. A conj or neg view's
            # are not (copy_ resolves the flag), nor a subclass's (no data pointer of its own).
            if self._native is not None and type(t) is torch.Tensor and not (t.is_conj() or t.is_neg()):
                try:
                    host, view = extension().offload_copy_out(t, self._native, d2h.stream_id,
                                                              d2h.device_index, d2h.device_type)
                finally:
                    pool._warn_notices()
            else:
                d2h.wait_stream(torch.cuda.current_stream(t.device))
                host = pool.empty(t.numel(), t.dtype, stream=d2h)
                view = host.as_strided(t.shape, t.stride())
                with torch.cuda.stream(d2h):
                    view.copy_(t, non_blocking=True)
                t.record_stream(d2h)
            h.d2h_event = d2h.record_event()
        else:
            d2h = None
            host = pool.empty(t.numel(), t.dtype)
            view = host.as_strided(t.shape, t.stride())
            view.copy_(t)
            h.d2h_event = None
        h.host, h.host_base = view, host
        step.refs.append(weakref.ref(h))
        self._moved_bytes += nbytes
        if self.observer is not None:
            self.observer("out", h, d2h)
        return h

    def _unpack(self, obj):
        if type(obj) is tuple:  # a save that stayed
            t, version = obj
            if t._version != version:
                raise _modified_in_place(t, version)
            step = self._backward
            if step is not None and step.worth_a_look():
                self._fetch_ahead(step)  # what backward freed meanwhile may make room
            return t
        source = obj.source()
        if source is not None and source._version != obj.version:
            raise _modified_in_place(source, obj.version)
        if self.observer is not None:
            self.observer("need", obj, None)
        self._fetch(obj, urgent=True)
        self._fetch_ahead(obj.step)
        out, obj.used = obj.fetched, True
        obj.unpacks -= 1
        if obj.unpacks <= 0:  # the last of its saves (Note [Shared storages]); a retained graph fetches again
            obj.fetched = None
        if out.device.type == "cuda":
            if self._native is not None:
                extension().offload_use(out, obj.h2d_event.cuda_event)
            else:
                current = torch.cuda.current_stream(out.device)
                current.wait_event(obj.h2d_event)
                out.record_stream(current)
        if self.observer is not None:
            self.observer("used", obj, None)
        return out

    # ------------------------------------------------------------- fetching
    def _fetch(self, h, urgent=False):
        if h.fetched is not None:
            return
        h.step.fetched += h.nbytes
        if h.device.type == "cuda":
            _, h2d, now = self._streams_for(h.device)
            h2d = now if urgent else h2d  # backward waits for this one: not behind queued fetches
            if self._native is not None:
                out = extension().offload_copy_in(h.host, h.host_base, self._native, h.device.index,
                                                  h2d.stream_id, h2d.device_index, h2d.device_type,
                                                  h.d2h_event.cuda_event)
            else:
                h2d.wait_event(h.d2h_event)
                with torch.cuda.stream(h2d):
                    out = torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=h.device)
                    out.copy_(h.host, non_blocking=True)
                self._host_pool().record_stream(h.host_base, h2d)
            h.h2d_event = h2d.record_event()
        else:
            h2d = None
            out = torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=h.device)
            out.copy_(h.host)
        h.step.track_fetched(out, h.nbytes)
        h.fetched = out
        if self.observer is not None:
            self.observer("urgent" if urgent else "in", h, h2d)

    def _fetch_ahead(self, step):
        """Starts fetching `step`'s offloaded tensors whose copy out finished, latest-saved
        first, while each fits in the room its backward has made (Note [Offload streams])."""
        while step.ready < len(step.refs):  # copies out finish in save order (one stream)
            h = step.refs[step.ready]()
            if h is not None and h.d2h_event is not None and not h.d2h_event.query():
                break
            step.ready += 1
        refs = step.refs
        if step.end is None:  # backward inside the context, or a forward since the last look
            step.end, step.cursor = len(refs), None
        while step.end > 0 and _done(refs[step.end - 1]()):  # backward's order: the last saved go first
            step.end -= 1
        # Below `end`, tensors fetched ahead but not used yet are done too: start under them, or
        # every unpack walks all of them again (quadratic in the saved tensors of a step).
        cursor = step.end if step.cursor is None else min(step.cursor, step.end)
        while cursor > 0 and _done(refs[cursor - 1]()):
            cursor -= 1
        step.cursor = cursor
        # The next tensor backward needs may take the floor only if it is out already; tensors
        # still on their way out (at and past `ready`) are not looked at.
        allowance = step.floor if step.end <= step.ready else 0
        step.freed_seen, step.looked_at = step.freed, time.perf_counter()
        for i in range(min(cursor, step.ready) - 1, -1, -1):
            h = refs[i]()
            if _done(h):
                continue
            if not step.has_room(h, allowance):
                break
            self._fetch(h)

    def _streams_for(self, device):
        streams = self._streams.get(device)
        if streams is None:  # out, in ahead of use, in for a tensor backward waits for
            streams = (torch.cuda.Stream(device), torch.cuda.Stream(device),
                       torch.cuda.Stream(device, priority=-1))
            self._streams[device] = streams
        return streams

    def _host_pool(self):
        if self._pool is None:
            self._pool = pinned_host.default_pool()
        if self._native is _UNRESOLVED:  # Note [Offload copies]
            self._native = self._pool._pool if self._pool.device is not None and _native_copies() else None
        return self._pool


_UNRESOLVED = object()


def _storage_of(t):
    """(t's untyped storage, its address), or (None, None) where t has no real storage of its
    own (a fake or functional tensor while tracing, a wrapper subclass)."""
    try:
        storage = t.untyped_storage()
        return storage, storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None, None


def _modified_in_place(t, saved_version):
    """Autograd's own error for a saved tensor written in place (Note [Saved versions])."""
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
        f"{saved_version} instead (checked by torchmem.offload_activations: PyTorch skips this check "
        f"while saved-tensor hooks are active). Hint: make the in-place operation out of place, "
        f"or clone the tensor before writing to it.")


def _signature(t):
    """What two saves of one storage must agree on to share a host copy (Note [Shared
    storages]): the same elements, the same version (not written to in between), the same
    conj/neg view flags."""
    return (t.storage_offset(), t.shape, t.stride(), t.dtype, t._version, t.is_conj(), t.is_neg())


def _native_copies():
    """Whether the hooks may use torchmem._C's one-call copies (Note [Offload copies])."""
    if os.environ.get("TORCHMEM_OFFLOAD_COPIES", "native") == "python":
        return False
    return hasattr(extension(), "offload_copy_out")


def plan_offload(sizes, budget_bytes):
    """The indices of `sizes` (bytes of saved tensors in save order) to move so
    that at most `budget_bytes` stay, largest x longest-lived first (Note [What
    moves]). None budget: all of them."""
    if budget_bytes is None:
        return set(range(len(sizes)))
    need = sum(sizes) - budget_bytes
    if need <= 0:
        return set()
    count = len(sizes)
    order = sorted(range(count), key=lambda i: (-sizes[i] * (count - i), i))
    chosen, moved = set(), 0
    for i in order:
        if moved >= need:
            break
        chosen.add(i)
        moved += sizes[i]
    return chosen
