"""torchmem.runtime: the allocator glue around the compiled module torchmem._C.

config (the options and their parsing; torchmem/installer.py, above this
package, installs them), stats and patch (torch.cuda's memory API over torchmem's pool), hooks
(OOM hooks), snapshots, snapshot_format and stacks (what the pool holds in
torch's snapshot format, and who allocated it; replays use the same format),
leak (leak checks), torch_alloc_conf (PYTORCH_CUDA_ALLOC_CONF), budget (the
memory budget the batch controller reads and sharing moves). Every call into
torchmem._C goes through torchmem._loader, the one module that imports it.

The public names are re-exported by torchmem/__init__.py; this package imports
nothing itself, so importing one of its modules loads only what that module needs.
"""
