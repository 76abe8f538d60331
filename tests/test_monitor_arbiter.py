"""The sharing rule (torchmem/share/arbiter.py) as a pure function: no files, no processes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from torchmem.share.arbiter import Member, decide

G = 1 << 30
GRAN = 2 << 20


def test_idle_owner_lends_and_a_borrower_gets_it():
    owner = Member(pid=1, guarantee=40 * G, reserved=5 * G, live_peak=5 * G)
    borrower = Member(pid=2, guarantee=40 * G, reserved=40 * G, live_peak=40 * G)
    d = decide([owner, borrower], capacity=100 * G)
    assert d.borrowers == (2,)
    assert d.limits[1] == 40 * G  # the owner can always grow back to its share
    assert d.limits[2] == 40 * G + (100 - 5 - 40) * G  # its share + the unguaranteed 20 + the owner's idle 35


def test_owner_need_takes_the_share_back_from_borrowers():
    owner = Member(pid=1, guarantee=40 * G, reserved=5 * G, live_peak=5 * G, need=30 * G)
    borrower = Member(pid=2, guarantee=40 * G, reserved=90 * G, live_peak=90 * G)
    d = decide([owner, borrower], capacity=100 * G)
    assert d.limits[2] == 70 * G  # 100 - owner's 30 in use
    assert d.limits[1] == 40 * G and 1 not in d.borrowers


def test_spare_is_split_by_guarantee_and_rounded_to_the_granule():
    members = [Member(pid=1, guarantee=10 * G, live_peak=10 * G), Member(pid=2, guarantee=30 * G, live_peak=30 * G),
               Member(pid=3, guarantee=20 * G, live_peak=1 * G)]
    d = decide(members, capacity=100 * G + 12345)
    spare = 100 * G + 12345 - 10 * G - 30 * G - 1 * G
    assert d.limits[1] - 10 * G == (spare // 4) // GRAN * GRAN
    assert d.limits[2] - 30 * G == (spare * 3 // 4) // GRAN * GRAN
    assert d.limits[3] == 20 * G


def test_pressed_member_borrows_below_its_guarantee():
    d = decide([Member(pid=1, guarantee=40 * G, live_peak=20 * G, pressed=True)], capacity=80 * G)
    assert d.borrowers == (1,) and d.limits[1] == 80 * G  # its 40 + the unguaranteed 40


def test_idle_cache_is_trimmed_only_while_someone_borrows():
    owner = Member(pid=1, guarantee=40 * G, reserved=30 * G, live_peak=2 * G)
    quiet = Member(pid=2, guarantee=40 * G, reserved=10 * G, live_peak=10 * G)
    assert decide([owner, quiet], capacity=100 * G).trim == ()
    borrower = Member(pid=2, guarantee=40 * G, reserved=40 * G, live_peak=40 * G)
    d = decide([owner, borrower], capacity=100 * G)
    assert d.trim == (1,)
    assert d.trim_to == {1: 2 * 2 * G + 4 * (2 << 20)}  # twice its demand: room for a step's fragmentation
    assert d.limits[2] == (100 - 30) * G  # the owner's cache is not lent while it still holds it
    trimmed = Member(pid=1, guarantee=40 * G, reserved=2 * G, live_peak=2 * G)
    assert decide([trimmed, borrower], capacity=100 * G).limits[2] == (100 - 2) * G


def test_an_owner_is_trimmed_once_not_every_tick():
    # A step holds more than its live peak (fragmentation): trimming to the bare peak
    # had a light process on the H200 map and give back memory every step.
    borrower = Member(pid=2, guarantee=40 * G, reserved=60 * G, live_peak=60 * G)
    light = Member(pid=1, guarantee=40 * G, reserved=int(1.5 * 5 * G), live_peak=5 * G)
    assert decide([light, borrower], capacity=100 * G).trim == ()
    former_borrower = Member(pid=1, guarantee=40 * G, reserved=38 * G, live_peak=5 * G)
    d = decide([former_borrower, borrower], capacity=100 * G)
    assert d.trim == (1,)
    trimmed = Member(pid=1, guarantee=40 * G, reserved=d.trim_to[1], live_peak=5 * G)
    assert decide([trimmed, borrower], capacity=100 * G).trim == ()  # at its mark: left alone


def test_guarantees_above_the_device_are_scaled_against_the_total_not_the_moment():
    members = [Member(pid=i, guarantee=60 * G) for i in (1, 2)]
    d = decide(members, capacity=10 * G, total=100 * G)  # most of the device is held elsewhere right now
    assert d.scaled
    assert d.limits == {1: 50 * G, 2: 50 * G}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 120), st.integers(0, 60), st.booleans()),
                min_size=1, max_size=5),
       st.integers(0, 200))
def test_invariants(raw, capacity_g):
    """Owners' limits are their (scaled) guarantees; what borrowers get beyond theirs is at most
    what the capacity leaves after the owners' use and the borrowers' own shares."""
    members = [Member(pid=i + 1, guarantee=g * G, reserved=p * G, live_peak=p * G, need=(n * G if n % 3 == 0 else 0),
                      pressed=pressed) for i, (g, p, n, pressed) in enumerate(raw)]
    capacity = capacity_g * G
    total = max(capacity, 100 * G)
    d = decide(members, capacity, total)
    factor = min(1.0, total / sum(m.guarantee for m in members))
    share = {m.pid: max(GRAN, int(m.guarantee * factor) // GRAN * GRAN) for m in members}
    assert all(d.limits[m.pid] >= share[m.pid] for m in members)
    owners = [m for m in members if m.pid not in d.borrowers]
    assert all(d.limits[m.pid] == share[m.pid] for m in owners)
    used = sum(min(max(m.live_peak, m.need, m.reserved), share[m.pid]) for m in owners)
    borrowed = sum(d.limits[p] - share[p] for p in d.borrowers)
    assert borrowed <= max(0, capacity - used - sum(share[p] for p in d.borrowers))
    assert all(m.need == 0 for m in members if m.pid in d.borrowers)


def test_a_waiting_owner_makes_the_decision_urgent():
    borrower = Member(pid=2, guarantee=40 * G, reserved=60 * G, live_peak=60 * G)
    calm = Member(pid=1, guarantee=40 * G, reserved=5 * G, live_peak=5 * G)
    assert not decide([calm, borrower], capacity=100 * G).urgent
    waiting = Member(pid=1, guarantee=40 * G, reserved=5 * G, live_peak=5 * G, need=30 * G)
    d = decide([waiting, borrower], capacity=100 * G)
    assert d.urgent and d.as_dict()["urgent"] is True
