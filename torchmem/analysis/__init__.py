"""torchmem.analysis: offline work on recorded allocation traces; no GPU needed.

trace (reading and writing traces), replay (a trace through torchmem's pool on
a simulated device), patterns (size and lifetime patterns of a trace), plot (figures of a trace).
The CLI's convert, replay, stats and plot commands are built on these.

This package imports nothing itself: each module loads only what it needs.
"""
