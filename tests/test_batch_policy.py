"""SizingPolicy (torchmem/batch/policy.py) alone: the controller's arithmetic,
no torch, no micro-steps."""

from torchmem.batch.policy import SizingPolicy


def make(**kwargs):
    events = []
    options = dict(quantum=8, min_micro=1, margin=0.0, grow_after=3, window=8,
                   record=lambda *event: events.append(event))
    options.update(kwargs)
    return SizingPolicy(**options), events


def test_sizes_stay_on_the_grid():
    policy, _ = make()
    assert [policy.quantize(n, cap=64) for n in (1, 3, 7, 8, 13, 63, 64, 100)] == [1, 2, 4, 8, 8, 56, 64, 64]
    assert make(min_micro=4)[0].quantize(2, cap=64) == 4


def test_shrink_halves_cold_and_follows_the_line_once_fitted():
    policy, _ = make()
    assert policy.shrink_target(32, budget=None, cap=64) == 16          # nothing known: halve
    for micro in (8, 16):
        policy.note_success(micro, 1000 + 100 * micro)                  # peak = 1000 + 100 x micro
    policy.note_oom(32, budget=3000, oom_here=True)
    assert policy.ceiling == 32
    assert policy.shrink_target(32, budget=3000, cap=64) == 16          # largest under 3000 is 20 -> grid 16


def test_grows_to_the_largest_fit_below_the_ceiling():
    policy, events = make()
    for micro in (8, 16):
        policy.note_success(micro, 1000 + 100 * micro)
    assert policy.grow_or_keep(16, peak=2600, budget=8000, cap=128) == 64   # (8000 - 1000) / 100 = 70 -> 64
    policy.note_oom(64, budget=8000, oom_here=True)
    assert policy.grow_or_keep(48, peak=5800, budget=8000, cap=128) == 56   # below the ceiling of 64
    # The budget rising past the one at the OOM lifts the ceiling.
    assert policy.grow_or_keep(56, peak=6600, budget=9000, cap=128) == 80
    assert events and events[-1][0] == "ceiling"


def test_without_figures_it_probes_up_after_clean_steps_and_backs_off():
    policy, _ = make(grow_after=2)
    policy.note_oom(16, budget=None, oom_here=True)
    for _ in range(2):
        policy.note_success(8, None)
    probe = policy.grow_or_keep(8, peak=None, budget=None, cap=64)
    assert probe == 16 and policy.probe_size == 16                      # halfway to the ceiling is off-grid: the ceiling
    policy.note_oom(16, budget=None, oom_here=True)
    assert policy.failed_probes == 1
    assert policy.shrink_target(16, budget=None, cap=64) == 8           # back to what held
    for _ in range(2):
        policy.note_success(8, None)
    assert policy.grow_or_keep(8, peak=None, budget=None, cap=64) == 8  # the wait grew 4x


def test_state_round_trips():
    policy, _ = make()
    policy.note_success(8, 1800)
    policy.note_oom(16, budget=5000, oom_here=True)
    other, _ = make()
    other.load_state_dict(policy.state_dict())
    assert other.state_dict() == policy.state_dict()
