"""The eviction policies' own rules (the allocator's safety is tested elsewhere)."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest

from ec_core.policy_names import DEFAULT_POLICY, POLICY_NAMES
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_core.scheduler_process.frequency_sketch import FrequencySketch
from ec_core.scheduler_process.policy import POLICIES, make_policy
from ec_core.scheduler_process.policy_lru import LRUPolicy
from ec_core.scheduler_process.policy_s3lfu import S3LFUPolicy
from ec_core.scheduler_process.policy_wtinylfu import MAX_UNSIZED, WTinyLFUPolicy
from ec_core.scheduler_process.shadows import ShadowLRU, ShadowTinyLFU


def _save(alloc: BlockAllocator, key: str, n: int, *, seen: int = 1) -> bool:
    for _ in range(seen):
        alloc.note_request(key)
    entry = alloc.alloc(key, n)
    if entry is None:
        return False
    alloc.mark_ready(key)
    return True


def _hit(alloc: BlockAllocator, key: str) -> None:
    alloc.note_request(key)
    alloc.pin(key)
    alloc.unpin(key)


def test_make_policy_knows_every_configured_name() -> None:
    assert isinstance(make_policy("lru", 100), LRUPolicy)
    assert isinstance(make_policy("s3lfu", 100), S3LFUPolicy)
    assert isinstance(make_policy("wtinylfu", 100), WTinyLFUPolicy)
    assert set(POLICIES) == {"lru", "s3lfu", "wtinylfu"}
    assert DEFAULT_POLICY == "wtinylfu"
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo", 100)
    with pytest.raises(ValueError, match="cannot have -1 blocks"):
        make_policy("wtinylfu", -1)


def test_the_light_policy_names_are_exactly_the_registry() -> None:
    """`ec_core.policy_names` (what every process validates against) and the registry
    (what the scheduler builds from) name the same policies."""
    assert tuple(sorted(POLICIES)) == POLICY_NAMES
    assert DEFAULT_POLICY in POLICIES


def test_settings_import_no_policy_implementation() -> None:
    """Every process imports `ec_core.settings`; only the scheduler process needs the
    policies, so importing the settings imports nothing of `scheduler_process`."""
    code = (
        "import sys, ec_core.settings; "
        "print([m for m in sorted(sys.modules) if m.startswith('ec_core.scheduler_process')])"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_s3lfu_probation_goes_first_and_a_hit_promotes() -> None:
    alloc = BlockAllocator(100, S3LFUPolicy(100, small_fraction=0.2))
    policy = alloc.policy
    for key in "abcd":
        assert _save(alloc, key, 20)
    _hit(alloc, "a")  # promoted to main
    # probation holds b, c, d (60 blocks) > its 20-block share: evicted first, oldest first
    assert list(policy.candidates())[:3] == ["b", "c", "d"]
    assert _save(alloc, "e", 30)
    assert "a" in alloc and "b" not in alloc and "c" not in alloc


def test_s3lfu_promotes_on_a_request_not_on_a_pin() -> None:
    """vLLM looks a waiting request's item up, and the scheduler pins it, at every
    step until the request is scheduled: the pins promote nothing; the request, once
    it comes, does, even while the entry sits listed on probation (no pin after it)."""
    alloc = BlockAllocator(100, S3LFUPolicy(100, small_fraction=0.2))
    policy = alloc.policy
    assert isinstance(policy, S3LFUPolicy)
    for key in "abcd":
        assert _save(alloc, key, 20)
    for _ in range(3):
        alloc.pin("a")
        alloc.unpin("a")
    assert "a" in policy._in_small and list(policy.candidates())[:4] == ["b", "c", "d", "a"]
    alloc.note_request("a")
    assert "a" not in policy._in_small
    assert list(policy.candidates()) == ["b", "c", "d", "a"], "a heads main, after probation"
    assert policy._small_blocks == 60
    alloc.note_request("e")
    assert alloc.alloc("e", 10) is not None  # its save under way: not ready
    alloc.note_request("e")
    assert "e" in policy._in_small and "e" in policy._trial, "no hit before its save is done"
    alloc.check()


def test_s3lfu_main_keeps_the_frequent_entries() -> None:
    alloc = BlockAllocator(60, S3LFUPolicy(60, small_fraction=0.01))
    for key in ("hot", "warm", "cold"):
        assert _save(alloc, key, 20)
        _hit(alloc, key)  # all three in main
    for _ in range(5):
        _hit(alloc, "hot")
    _hit(alloc, "warm")
    assert _save(alloc, "new", 20, seen=2)
    assert "cold" not in alloc
    assert "hot" in alloc and "warm" in alloc


def test_s3lfu_ghost_hit_goes_straight_to_main() -> None:
    alloc = BlockAllocator(40, S3LFUPolicy(40, small_fraction=0.2))
    assert _save(alloc, "x", 20)
    assert _save(alloc, "y", 20)
    assert _save(alloc, "z", 20)  # x leaves probation unhit: remembered in the ghost list
    assert "x" not in alloc
    assert _save(alloc, "x", 20)
    policy = alloc.policy
    assert isinstance(policy, S3LFUPolicy)
    assert "x" not in policy._in_small, "a ghost hit enters main directly"


def test_s3lfu_stops_saving_first_sightings_that_never_recur() -> None:
    """A scan of one-off items: after the payoff average drops, most are not saved."""
    policy = S3LFUPolicy(1000, small_fraction=0.2)
    alloc = BlockAllocator(1000, policy)
    saved = sum(_save(alloc, f"scan{i}", 10) for i in range(600))
    assert policy.first_sighting_payoff < policy.admit_threshold
    assert saved < 300, "one-offs must stop being written"
    assert alloc.last_refusal in ("admission", None)
    # Items seen before are always saved, whatever the mood.
    alloc.note_request("again")
    assert _save(alloc, "again", 10)


def test_s3lfu_keeps_saving_first_sightings_that_recur_soon() -> None:
    """Chat-like: every new image is requested again soon after."""
    policy = S3LFUPolicy(1000, small_fraction=0.2)
    alloc = BlockAllocator(1000, policy)
    refused = 0
    for i in range(600):
        if not _save(alloc, f"img{i}", 10):
            refused += 1
            continue
        _hit(alloc, f"img{i}")
    assert refused == 0
    assert policy.first_sighting_payoff > policy.admit_threshold


def test_policy_histories_stay_bounded() -> None:
    policy = S3LFUPolicy(10)
    for i in range(200_000):
        policy.on_request(f"k{i}", False)
    assert len(policy._history.counts) <= policy._history.limit


def test_policies_report_whether_they_evict_as_plain_lru() -> None:
    """`stats()`: lru always evicts as plain LRU, s3lfu never; wtinylfu while in its
    recency mode, and it counts its mode changes."""
    assert LRUPolicy().stats() == {"policy_lru_mode": 1.0}
    assert S3LFUPolicy(100).stats() == {"policy_lru_mode": 0.0}
    policy = WTinyLFUPolicy(100)
    assert policy.stats() == {"policy_lru_mode": 1.0, "policy_mode_changes": 0.0}
    policy._set_recency_mode(False)
    assert policy.stats() == {"policy_lru_mode": 0.0, "policy_mode_changes": 1.0}
    policy._set_recency_mode(True)
    assert policy.stats() == {"policy_lru_mode": 1.0, "policy_mode_changes": 2.0}


def test_wtinylfu_duel_keeps_frequent_main_entries_against_a_one_off() -> None:
    policy = WTinyLFUPolicy(125, window_fraction=0.01)
    policy._set_recency_mode(False)  # (it starts as LRU)
    alloc = BlockAllocator(125, policy)
    for key in ("a", "b", "c", "d"):
        assert _save(alloc, key, 25, seen=2)
        for _ in range(4):
            _hit(alloc, key)
    assert _save(alloc, "once", 25, seen=2)  # fills the pool; rarer than the main entries
    assert next(policy.candidates()) == "once", "it lost its duel: the first victim"
    assert _save(alloc, "next", 5, seen=2)
    assert "once" not in alloc, "the candidate lost its duel and left first"
    assert all(key in alloc for key in "abcd")


def test_wtinylfu_recency_traffic_keeps_the_window_at_the_whole_pool() -> None:
    """Recency traffic: the policy starts as LRU and the frequency side never
    proves better, so the window stays the whole pool."""
    policy = WTinyLFUPolicy(1000, window_fraction=0.01)
    alloc = BlockAllocator(1000, policy)
    for i in range(400):
        for key in (f"img{i}", f"img{i - 5}", f"img{i - 12}"):
            if i < 12 and key.startswith("img-"):
                continue
            alloc.note_request(key)
            entry = alloc.get(key)
            if entry is None:
                if alloc.alloc(key, 40) is not None:
                    alloc.mark_ready(key)
            elif entry.evictable:
                alloc.pin(key)
                alloc.unpin(key)
    assert policy.recency_mode and policy.window_share == 1.0


def test_wtinylfu_doorkeeper_stops_writing_one_offs() -> None:
    policy = WTinyLFUPolicy(1000)
    alloc = BlockAllocator(1000, policy)
    saved = sum(_save(alloc, f"scan{i}", 10) for i in range(2000))
    assert policy.first_sighting_payoff < policy.admit_threshold
    assert saved < 1000
    alloc.note_request("again")
    assert _save(alloc, "again", 10), "an item seen before is always saved"


def _replay(alloc: BlockAllocator, keys: list[str], blocks: int) -> int:
    """Drive `keys` the scheduler's way; the blocks served from the pool."""
    served = 0
    for key in keys:
        alloc.note_request(key)
        entry = alloc.get(key)
        if entry is None:
            if alloc.alloc(key, blocks) is not None:
                alloc.mark_ready(key)
        elif entry.evictable:
            served += blocks
            alloc.pin(key)
            alloc.unpin(key)
    return served


def _sliding_sessions(turns: int, start: int = 0) -> list[str]:
    """Recency traffic: 10 chats in turn, each re-sending its last three images
    and adding one every turn (an image's past count says nothing)."""
    keys: list[str] = []
    for turn in range(start, start + turns):
        chat, step = turn % 10, turn // 10
        keys.extend(f"c{chat}i{step - back}" for back in (2, 1, 0) if step - back >= 0)
    return keys


def _hot_set_with_scans(rounds: int) -> list[str]:
    """Frequency traffic: 20 hot items, each round interrupted by 30 one-offs."""
    keys: list[str] = []
    for r in range(rounds):
        keys.extend(f"hot{i}" for i in range(20))
        keys.extend(f"scan{r}x{i}" for i in range(30))
    return keys


def test_wtinylfu_guard_enters_recency_mode_on_recency_traffic_and_leaves_it() -> None:
    """The shadow LRU beats the frequency shadow on sliding chats: the policy
    becomes LRU (window = pool) and then serves what LRU serves; a hot set
    behind scans brings the frequency side back, and it beats LRU there."""
    pool = 40 * 10
    policy = WTinyLFUPolicy(pool)
    assert policy.recency_mode, "it starts as LRU"
    policy._set_recency_mode(False)
    alloc = BlockAllocator(pool, policy)
    recency = _sliding_sessions(1500)
    _replay(alloc, recency[:600], 10)
    assert policy.recency_mode and policy.window_share == 1.0
    assert policy.strict_order, "the allocator keeps LRU's order exactly"
    served = _replay(alloc, recency[600:], 10)
    lru = BlockAllocator(pool, LRUPolicy())
    _replay(lru, recency[:600], 10)
    assert served >= 0.99 * _replay(lru, recency[600:], 10)

    frequency = _hot_set_with_scans(60)
    _replay(alloc, frequency[:1500], 10)
    assert not policy.recency_mode and policy.mode_changes >= 3
    served = _replay(alloc, frequency[1500:], 10)
    _replay(lru, frequency[:1500], 10)
    assert served > 1.2 * _replay(lru, frequency[1500:], 10)


def test_wtinylfu_recency_mode_moves_every_hit_to_the_window() -> None:
    policy = WTinyLFUPolicy(100)
    alloc = BlockAllocator(100, policy)
    for key in "abcd":
        assert _save(alloc, key, 20, seen=2)
    policy._set_recency_mode(True)
    assert policy.window_target == 100
    _hit(alloc, "a")
    assert policy._segment["a"] == 0  # the window
    assert _save(alloc, "e", 20, seen=2)
    assert _save(alloc, "f", 20, seen=2)
    assert "a" in alloc, "the most recently hit entry outlives older ones"
    policy._set_recency_mode(False)
    assert policy.window_target == policy.initial_window
    assert policy.segment_blocks()["window"] <= max(policy.window_target, 20)


def test_wtinylfu_sketch_keeps_counts_through_warm_up_growth() -> None:
    """While the pool fills, the sketch grows (1024 -> 8192 -> 65536 counters a row)
    under the policy's own growth rule: no key's estimate drops below its request
    count since the last halving (none here), whatever grew in between."""
    policy = WTinyLFUPolicy(100_000, sketch_period_factor=1e6)
    alloc = BlockAllocator(100_000, policy)
    requested: dict[str, int] = {}
    widths = [policy.sketch.width]
    for i in range(5_000):
        keys = [f"k{i}", f"k{i // 3}", f"k{i // 7}"]
        for key in keys:
            requested[key] = requested.get(key, 0) + 1
        _replay(alloc, keys, 1)
        if policy.sketch.width != widths[-1]:
            widths.append(policy.sketch.width)
            lost = [k for k, n in requested.items() if policy.sketch.estimate(k) < min(n, 15)]
            assert not lost, f"growth to {widths[-1]} lost the counts of {lost[:5]}"
    assert widths == [1024, 8192, 65536] and policy.sketch.resets == 0
    assert all(policy.sketch.estimate(k) >= min(n, 15) for k, n in requested.items())


def test_wtinylfu_guard_fires_when_the_policy_gets_no_hits() -> None:
    """The guard's samples count every requested block, hit or miss: a policy that
    serves nothing (here every save fails and is discarded) still follows the
    shadow LRU into recency mode on recency traffic."""
    pool = 40 * 10
    policy = WTinyLFUPolicy(pool)
    policy._set_recency_mode(False)  # (it starts as LRU)
    alloc = BlockAllocator(pool, policy)
    hits = 0
    for key in _sliding_sessions(600):
        alloc.note_request(key)
        if alloc.get(key) is not None:
            hits += 1
        elif alloc.alloc(key, 10) is not None:
            alloc.discard(key)  # the save failed: the entry never became ready
    assert hits == 0
    assert policy.recency_mode and policy.mode_changes >= 1


def test_s3lfu_history_bound_follows_the_entries_down() -> None:
    """The request history may hold 8 keys per entry; once the pool holds fewer
    entries (many small ones replaced), the bound comes back down with them."""
    pool = 20_000
    policy = S3LFUPolicy(pool)
    alloc = BlockAllocator(pool, policy)
    for i in range(pool):
        assert _save(alloc, f"small{i}", 1, seen=2)
    assert policy._history.limit >= 8 * (pool - 1)  # grown with the entries
    for i in range(pool):
        alloc.drop(f"small{i}")
    for i in range(3 * (1 << 16)):
        alloc.note_request(f"later{i}")
    assert policy._history.limit == 1 << 16
    assert len(policy._history.counts) <= 1 << 16


def test_wtinylfu_keeps_a_stable_part_of_a_loop_larger_than_the_pool() -> None:
    """A loop over 60 items that needs 1.5 pools: LRU serves nothing (each item
    is evicted just before its turn). Every item of the loop is asked for as
    often as any other, so a candidate never outranks a resident by more than
    the request that brought it (the duel margin), and the policy keeps a
    fixed two thirds of the loop: about 2/3 of the requests are served once
    the loop has gone round a few times."""
    pool = 400
    policy = WTinyLFUPolicy(pool)
    alloc = BlockAllocator(pool, policy)
    loop = [f"loop{i}" for i in range(60)]
    _replay(alloc, loop * 10, 10)  # warm-up: the guard leaves recency mode
    assert not policy.recency_mode
    served = _replay(alloc, loop * 20, 10)
    requested = 20 * 60 * 10
    assert served >= 0.55 * requested
    lru = BlockAllocator(pool, LRUPolicy())
    _replay(lru, loop * 10, 10)
    assert _replay(lru, loop * 20, 10) == 0


def test_wtinylfu_duel_margin_keeps_a_resident_asked_for_as_often() -> None:
    """A candidate whose count equals the residents' (one request more than
    before it came) loses: it goes to outgoing and the residents stay."""
    policy = WTinyLFUPolicy(100, window_fraction=0.01)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(100, policy)
    for key in "abcd":
        assert _save(alloc, key, 25, seen=2)
    assert _save(alloc, "e", 25, seen=2)  # as often as a-d (2 requests each)
    assert set(policy.evictable_in(2)) == {"e"}, "it lost its duel"
    assert _save(alloc, "f", 25, seen=3)  # asked for more often: it wins
    assert all(key in alloc for key in "abcd") or "e" not in alloc
    assert "e" not in alloc, "the loser left first"


def test_wtinylfu_refuses_a_save_that_would_evict_more_frequent_entries() -> None:
    """In frequency mode, a full pool: an item asked for less often than the
    main entries its allocation would evict is not saved, and nothing is
    evicted for it; one asked for more often is."""
    policy = WTinyLFUPolicy(100, window_fraction=0.01)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(100, policy)
    for key in "abcd":
        assert _save(alloc, key, 25, seen=4)
    alloc.drop("d")
    assert _save(alloc, "d", 25, seen=4)  # into the free quarter: nothing to evict
    assert not list(policy.evictable_in(2)), "no duel loser waiting to go"
    assert not _save(alloc, "rare", 25, seen=2)
    assert alloc.last_refusal == "admission"
    assert all(key in alloc for key in "abcd")
    assert _save(alloc, "hot", 25, seen=9)
    assert "hot" in alloc and sum(key in alloc for key in "abcd") == 3


def test_wtinylfu_the_first_overflow_of_a_filling_pool_duels_too() -> None:
    """In frequency mode, in a pool that has never let an entry go: an item whose
    allocation would overflow it, evicting main entries asked for more often, is
    refused (one large item does not flush a pool still filling up); one that
    fits in the free blocks is saved without a duel."""
    policy = WTinyLFUPolicy(100, window_fraction=0.01)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(100, policy)
    for key in "abc":
        assert _save(alloc, key, 20, seen=4)
    assert not _save(alloc, "large", 60, seen=1)
    assert alloc.last_refusal == "admission"
    assert all(key in alloc for key in "abc") and len(alloc) == 3
    assert _save(alloc, "fits", 40, seen=1)
    assert len(alloc) == 4


def test_wtinylfu_a_large_item_is_weighed_against_every_entry_it_would_evict() -> None:
    """A 600-block item asked for 6 times, a full pool of 100 small entries:
    10 asked for once, 90 asked for 9 times. Its allocation would evict the
    10 rare ones and 50 frequent ones: it loses, although it beats the rare
    ones it would evict first."""
    policy = WTinyLFUPolicy(1000, window_fraction=0.001)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(1000, policy)
    for i in range(100):
        assert _save(alloc, f"k{i}", 10, seen=1 if i < 10 else 9)
    assert not _save(alloc, "large", 600, seen=6)
    assert alloc.last_refusal == "admission" and len(alloc) == 100
    assert _save(alloc, "larger", 600, seen=12)  # more frequent than any of them


def test_wtinylfu_a_rare_victim_does_not_carry_a_tie_past_the_residents() -> None:
    """A pool nearly full: four entries asked for 4 times and one asked for once. A
    30-block item asked for 5 times (its count less the margin ties the four)
    would evict the rare entry and 10 blocks of a frequent one: it is refused,
    although it beats the blocks' mean (a mean would let it in, and on a loop
    it would replace each resident just before its turn). Asked for 6 times it
    outranks every entry it displaces and is saved."""
    policy = WTinyLFUPolicy(100, window_fraction=0.01)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(100, policy)
    for key in "abcd":
        assert _save(alloc, key, 20, seen=4)
    assert _save(alloc, "rare", 10, seen=1)
    assert not _save(alloc, "tied", 30, seen=5)
    assert alloc.last_refusal == "admission"
    assert all(key in alloc for key in ("a", "b", "c", "d", "rare"))
    assert _save(alloc, "hot", 30, seen=6)
    assert "rare" not in alloc and "hot" in alloc


def test_wtinylfu_a_candidate_enters_main_while_main_has_room() -> None:
    """A window candidate enters main without a duel while main's share of the pool
    has room for it: it is not parked in outgoing (where the next save would evict
    it) beside room main could give it."""
    policy = WTinyLFUPolicy(100, window_fraction=0.01)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(100, policy)
    for key in "abcd":
        assert _save(alloc, key, 24, seen=4)
    alloc.drop("a")
    assert _save(alloc, "e", 24, seen=2)  # rarer than b-d: it would lose a duel
    assert "e" in policy.evictable_in(1) and not policy.evictable_in(2)
    assert _save(alloc, "f", 4, seen=2)  # into the last free blocks; no room in main's share
    assert policy.evictable_in(2) == ["f"], "it lost its duel"
    assert len(alloc) == 5


def test_wtinylfu_guard_waits_for_its_warm_up_samples() -> None:
    """The guard takes no side during its first `guard_warmup` samples, however
    clear they look; the sample after them does."""
    policy = WTinyLFUPolicy(100)
    policy._set_recency_mode(False)
    for _ in range(policy.guard_warmup):
        policy._sample = [100, 100, 0]  # LRU served everything, the policy nothing
        policy._end_sample()
        assert not policy.recency_mode
    policy._sample = [100, 100, 0]
    policy._end_sample()
    assert policy.recency_mode


def test_wtinylfu_the_first_sample_after_a_change_of_mode_decides_alone() -> None:
    """A change of mode starts the guard's score afresh: the sample after it is the
    first to weigh the new mode's own side. One clear sample for frequency mode,
    then one where LRU serves a tenth of the requested blocks more than the policy:
    it goes back at once (the score carried over, -1 / 2 + 0.1, kept it in
    frequency mode for another sample)."""
    policy = WTinyLFUPolicy(100)
    policy._samples = policy.guard_warmup  # past the warm-up
    policy._sample = [100, 0, 100]  # the frequency expert served everything, LRU nothing
    policy._end_sample()
    assert not policy.recency_mode
    policy._sample = [100, 10, 0]  # LRU ahead by 0.1 of the requested blocks
    policy._end_sample()
    assert policy.recency_mode and policy.mode_changes == 2
    policy._sample = [100, 0, 0]  # a tie keeps the mode
    policy._end_sample()
    assert policy.recency_mode and policy.mode_changes == 2


def test_wtinylfu_an_entry_that_displaces_nothing_wins_its_duel() -> None:
    """The duel protects the blocks a candidate would take: one that needs none (a
    zero-block entry, or room enough) wins against any main part."""
    policy = WTinyLFUPolicy(100, window_fraction=0.01)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(100, policy)
    for key in "abcd":
        assert _save(alloc, key, 25, seen=9)
    assert policy._outranks(1, 0) and policy._outranks(1, -5)
    assert not policy._outranks(1, 1), "one block would displace an entry asked for 9 times"


def test_wtinylfu_one_huge_item_weighs_at_most_its_share_in_the_guard() -> None:
    """A request counts at most `guard_item_share` of the pool in the guard's
    samples: the frequency shadow hitting one item of half the pool does not
    outweigh LRU serving 30 small ones (with full weight, that one hit alone
    filled a sample and sent the policy into frequency mode)."""
    policy = WTinyLFUPolicy(800, guard_item_share=1 / 8, guard_sample=0.5)  # 400 blocks a sample
    policy._samples = policy.guard_warmup  # past the warm-up
    policy._lru.evicted = True  # the shadow LRU has been full: samples count
    policy._tiny.main["big"] = 400  # held by the frequency shadow only
    small = [f"s{i}" for i in range(30)]
    for key in small:
        policy._lru.order[key] = 10  # held by the shadow LRU only
    policy._lru.used = 300
    policy.on_request("big", False)
    assert policy._sample == [100, 0, 100], "the big hit counts 800 / 8 blocks"
    for key in small:
        policy.on_request(key, False)
    assert policy._samples == policy.guard_warmup + 1, "the sample ended"
    assert policy.recency_mode and policy.guard_score == pytest.approx(0.5)


def test_wtinylfu_shadows_follow_a_hash_sample_of_a_large_pools_small_items() -> None:
    """Once the shadow LRU would hold more than `max_shadow_entries` keys, the
    shadows follow only the small items whose key hash falls in a halved
    sample, each weighing its blocks times the sampling factor; items of at
    least capacity / `max_shadow_entries` blocks are always followed at their
    own weight. Memory and per-request work stay bounded."""
    pool = 20_000
    policy = WTinyLFUPolicy(pool, max_shadow_entries=64)
    alloc = BlockAllocator(pool, policy)
    big = [f"big{i}" for i in range(8)]  # 400 blocks each, over 20,000 / 64
    keys = [f"k{i % 1500}" for i in range(6000)]
    for i, key in enumerate(keys):
        _replay(alloc, [key], 10)
        if i % 100 == 0:
            _replay(alloc, [big[i // 100 % 8]], 400)
    bits = policy.shadow_rate_bits
    assert bits >= 4  # 1,500 small keys: a sixteenth of them is 94
    mask = (1 << bits) - 1
    small = {k: b for k, b in policy._lru.order.items() if not k.startswith("big")}
    assert small and all(zlib.crc32(k.encode()) & mask == 0 for k in small)
    assert all(b in (10 << bits, 10 << (bits - 1)) for b in small.values()), small
    assert set(big) <= set(policy._lru.order), "the big items are always followed"
    assert all(policy._lru.order[k] == 400 for k in big)
    assert len(policy._lru.order) <= 64 + 1
    assert policy._lru.used <= pool


def test_wtinylfu_shadows_learn_every_miss_told_before_its_save() -> None:
    """A caller that tells the policy of several requests before their saves: each
    miss's size, which comes with its save, reaches the shadows, not only the last
    one's."""
    policy = WTinyLFUPolicy(1000)
    alloc = BlockAllocator(1000, policy)
    keys = ["a", "b", "c"]
    for key in keys:
        alloc.note_request(key)
    for key in keys:
        assert alloc.alloc(key, 10) is not None
        alloc.mark_ready(key)
    assert set(keys) <= set(policy._lru.order) and set(keys) <= policy._tiny.keys()
    assert all(policy._lru.order[key] == 10 for key in keys)


def test_wtinylfu_waits_for_at_most_max_unsized_sizes() -> None:
    """Lookups that end in no save leave at most `MAX_UNSIZED` keys waiting; the
    oldest are forgotten first, and a later save of one of them teaches nothing."""
    policy = WTinyLFUPolicy(100_000)
    alloc = BlockAllocator(100_000, policy)
    keys = [f"k{i}" for i in range(MAX_UNSIZED + 10)]
    for key in keys:
        alloc.note_request(key)
    assert len(policy._unsized) == MAX_UNSIZED
    assert list(policy._unsized) == keys[10:]
    assert alloc.alloc(keys[0], 5) is not None
    assert keys[0] not in policy._lru.order, "forgotten: its size is not learned"
    assert alloc.alloc(keys[-1], 5) is not None
    assert policy._lru.order[keys[-1]] == 5 and keys[-1] not in policy._unsized


def test_wtinylfu_misses_waiting_for_their_sizes_follow_the_shadows_thinning() -> None:
    """A miss still waiting for its size when the shadows thin is learned at the new
    rate: only if its key is in the new hash sample, and weighed up by it."""
    policy = WTinyLFUPolicy(6400, max_shadow_entries=64)  # items under 100 blocks are small
    alloc = BlockAllocator(6400, policy)
    keys = [f"w{i}" for i in range(40)]
    for key in keys:
        alloc.note_request(key)
    for _ in range(3):
        policy._thin_shadows()
    mask = (1 << policy.shadow_rate_bits) - 1
    sampled = {key for key in keys if not zlib.crc32(key.encode()) & mask}
    assert 0 < len(sampled) < len(keys)
    for key in keys:
        assert alloc.alloc(key, 10) is not None
    assert set(policy._lru.order) == sampled
    assert all(policy._lru.order[key] == 10 << 3 for key in sampled)


def test_wtinylfu_a_miss_asked_for_again_waits_as_the_newest() -> None:
    policy = WTinyLFUPolicy(100_000)
    for key in ("a", "b", "a"):
        policy.on_request(key, False)
    assert list(policy._unsized) == ["b", "a"]


def test_shadow_reweigh_keeps_the_order_and_the_capacity() -> None:
    lru = ShadowLRU(100)
    for key in "abcd":
        lru.insert(key, 20)
    lru.reweigh(lambda key, blocks: None if key == "b" else blocks * 2)
    assert list(lru.order) == ["c", "d"] and lru.used == 80 and lru.evicted
    tiny = ShadowTinyLFU(100, 0.1, FrequencySketch(64))
    for key in "abcdefgh":
        tiny.insert(key, 10)
    tiny.reweigh(lambda key, blocks: None if key in "ab" else blocks)
    assert not {"a", "b"} & tiny.keys()
    assert tiny.window_used + tiny.main_used == sum(tiny.window.values()) + sum(tiny.main.values())


@pytest.mark.parametrize("max_shadow_entries", [1 << 30, 16])
def test_wtinylfu_guard_takes_the_same_sides_with_sampled_shadows(
    max_shadow_entries: int,
) -> None:
    """The guard's verdicts hold when the shadows follow a quarter of the keys
    (16 of the pool's 40 entries): recency mode on sliding chats, frequency mode
    on a hot set behind scans."""
    pool = 40 * 10
    policy = WTinyLFUPolicy(pool, max_shadow_entries=max_shadow_entries)
    policy._set_recency_mode(False)
    alloc = BlockAllocator(pool, policy)
    _replay(alloc, _sliding_sessions(1500), 10)
    assert policy.recency_mode
    _replay(alloc, _hot_set_with_scans(60), 10)
    assert not policy.recency_mode
    assert policy.shadow_rate_bits == (0 if max_shadow_entries > 40 else 2)


def test_wtinylfu_doorkeeper_keeps_first_sightings_that_pay_like_repeats() -> None:
    """Below `admit_threshold`, first sightings are still written while they pay
    off at least `admit_relative` of what saves of items seen before pay off;
    refused once they pay off much less (one-offs)."""
    policy = WTinyLFUPolicy(1000, admit_threshold=0.25, admit_relative=0.7)
    alloc = BlockAllocator(1000, policy)
    policy.first_sighting_payoff = 0.2
    policy.repeat_payoff = 0.25  # 0.2 >= 0.7 x 0.25: as good as repeats, nearly
    assert _save(alloc, "new1", 10)
    policy.first_sighting_payoff = 0.2
    policy.repeat_payoff = 0.9  # repeats pay far better: first sightings are one-offs
    assert not _save(alloc, "new2", 10)


def test_wtinylfu_repeat_payoff_learns_from_saves_of_items_seen_before() -> None:
    policy = WTinyLFUPolicy(100)
    alloc = BlockAllocator(100, policy)
    assert _save(alloc, "a", 10, seen=2) and _save(alloc, "b", 10, seen=2)
    _hit(alloc, "a")
    assert policy.repeat_payoff == 1.0, "a hit on a new save keeps the average at 1"
    alloc.drop("b")  # left without a hit
    assert policy.repeat_payoff == pytest.approx(1 - policy.ema_weight)
    assert not policy._repeat_trial, "both trials ended"


def test_wtinylfu_counts_a_hit_per_request_not_per_pin() -> None:
    """A pin protects an entry; the hit is its request's. vLLM pins an item again at
    each step's lookup while its request waits: those pins must not count as the
    frequency side's hits (the guard's sample) or end a first sighting's trial; nor
    is a request for an entry whose save has not finished a hit."""
    policy = WTinyLFUPolicy(100)
    alloc = BlockAllocator(100, policy)
    policy._set_recency_mode(False)
    assert _save(alloc, "a", 10)
    assert "a" in policy._trial
    for _ in range(3):
        alloc.pin("a")
        alloc.unpin("a")
    assert policy._sample[2] == 0 and "a" in policy._trial
    # (Until the shadow LRU has been full, each request starts the sample afresh:
    # `_sample[2]` is the last request's hit.)
    alloc.note_request("b")
    assert alloc.alloc("b", 10) is not None  # saving: not ready
    alloc.note_request("b")
    assert policy._sample[2] == 0 and "b" in policy._trial
    alloc.note_request("a")
    assert policy._sample[2] == 10 and "a" not in policy._trial
    alloc.mark_ready("b")
    alloc.note_request("b")
    assert policy._sample[2] == 10 and "b" not in policy._trial
    alloc.pin("b")  # a load in flight
    alloc.note_request("b")  # asked for again meanwhile: served, a hit (no new pin event)
    assert policy._sample[2] == 10
    alloc.unpin("b")
    alloc.check()
