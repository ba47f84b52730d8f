"""Tenant isolation by vLLM's `cache_salt`: tier keys, and the scheduler half keying
every entry, lookup, load and save by them (`ec_scheduler.tenancy`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest

from ec_core.settings import ECCPUSettings
from ec_scheduler import ECCPUScheduler
from ec_scheduler.tenancy import DIGEST_HEX, MEMO_MAX, SALT_MARK, TierKeys, identifier_of
from ectools.driving import (
    Item,
    SimulatedRanks,
    StepDriver,
    connector_output,
    make_request,
    scheduler_output,
)

H = "c" * 64
LORA = f"lora-3:{H}"
SALT_A = "tenant-A-salt-7f3e"
SALT_B = "tenant-B-salt-91c2"
SchedulerFactory = Callable[..., ECCPUScheduler]


def _keys(*, isolating: bool = True, secret: str | None = None) -> TierKeys:
    return TierKeys(isolating=isolating, secret=secret)


def _key(keys: TierKeys, identifier: str, salt: str | None) -> str:
    request = make_request("k", [Item(identifier)], cache_salt=salt)
    return keys.key(request, request.mm_features[0])


# ----------------------------------------------------------------- tier keys


def test_an_unsalted_key_is_the_identifier_and_a_salted_one_wraps_it() -> None:
    keys = _keys()
    assert _key(keys, H, None) == H
    assert _key(keys, H, "") == H, "an empty salt is no salt (as in vLLM's prefix cache)"
    salted = _key(keys, H, SALT_A)
    assert re.fullmatch(re.escape(H + SALT_MARK) + f"[0-9a-f]{{{DIGEST_HEX}}}", salted)
    assert SALT_A not in salted, "only the digest, never the salt"
    assert identifier_of(salted) == H and identifier_of(H) == H


def test_distinct_salts_get_distinct_keys_and_a_salt_always_the_same() -> None:
    keys = _keys()
    salts = [f"salt-{n}" for n in range(200)] + [SALT_A, SALT_B]
    made = {_key(keys, H, salt) for salt in salts}
    assert len(made) == len(salts) and H not in made
    assert _key(keys, H, SALT_A) == _key(keys, H, SALT_A) == _key(_keys(), H, SALT_A)


def test_a_lora_prefixed_identifier_is_wrapped_whole() -> None:
    keys = _keys()
    salted = _key(keys, LORA, SALT_A)
    assert salted.startswith(LORA + SALT_MARK) and identifier_of(salted) == LORA
    assert salted != _key(keys, H, SALT_A), "the LoRA prefix stays part of the key"


def test_isolation_off_keys_every_request_by_identifier() -> None:
    keys = _keys(isolating=False)
    assert _key(keys, H, SALT_A) == _key(keys, H, SALT_B) == H
    request = make_request("r", [Item("x"), Item(LORA)], cache_salt=SALT_A)
    assert keys.keys_of(request) == ["x", LORA]


def test_the_digest_is_keyed_by_the_secret_so_engines_sharing_it_agree() -> None:
    one, same = _keys(secret="shared-secret-1"), _keys(secret="shared-secret-1")
    other, unkeyed = _keys(secret="shared-secret-2"), _keys()
    assert _key(one, H, SALT_A) == _key(same, H, SALT_A)
    assert len({_key(k, H, SALT_A) for k in (one, other, unkeyed)}) == 3


def test_the_memo_of_digests_is_bounded() -> None:
    keys = _keys()
    first = keys.digest("s-0")
    for n in range(MEMO_MAX + 10):
        keys.digest(f"s-{n}")
    assert len(keys._memo) == MEMO_MAX
    assert "s-0" not in keys._memo and keys.digest("s-0") == first, "recomputed the same"


def test_keys_of_names_each_item_in_order() -> None:
    request = make_request("r", [Item("x"), Item("y")], cache_salt=SALT_B)
    keys = _keys()
    suffix = keys.suffix(request)
    assert keys.keys_of(request) == ["x" + suffix, "y" + suffix]


# ------------------------------------------------------------------ settings


def test_the_option_defaults_on_and_takes_only_a_bool() -> None:
    base = {"ec_cpu_bytes": 4096}
    assert ECCPUSettings.from_extra_config(base, block_size_bytes=512).isolate_cache_salt
    off = {**base, "ec_isolate_cache_salt": False}
    assert not ECCPUSettings.from_extra_config(off, block_size_bytes=512).isolate_cache_salt
    for bad in ("false", 0, 1, None):
        with pytest.raises(ValueError, match="ec_isolate_cache_salt"):
            ECCPUSettings.from_extra_config(
                {**base, "ec_isolate_cache_salt": bad}, block_size_bytes=512
            )


# ----------------------------------------------------------------- scheduler


def _save(scheduler: ECCPUScheduler, items: list[Item], salt: str | None) -> list[str]:
    """Save `items` for a request of `salt` and report the saves landed; the keys."""
    meta = StepDriver(scheduler).step([make_request("save", items, cache_salt=salt)]).meta
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    return list(meta.saves)


def _looks_up(scheduler: ECCPUScheduler, item: Item, salt: str | None, rid: str = "q") -> bool:
    """One step with one request of `salt`: whether its item was a hit (then loaded)."""
    step = StepDriver(scheduler).step([make_request(rid, [item], cache_salt=salt)])
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(step.meta)))
    return step.looked_up[item.identifier]


def test_an_entry_saved_for_a_salt_serves_only_that_salt(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler()
    keys = scheduler.tier_keys
    (saved,) = _save(scheduler, [Item(H)], SALT_A)
    assert saved == _key(keys, H, SALT_A) and H not in scheduler.allocator
    assert not _looks_up(scheduler, Item(H), SALT_B, "b"), "another tenant's entry"
    assert not _looks_up(scheduler, Item(H), None, "plain"), "unsalted requests do not see it"
    assert _looks_up(scheduler, Item(H), SALT_A, "a"), "the same salt hits"
    # Each miss was saved under its own key: three entries of one identifier.
    assert {_key(keys, H, salt) for salt in (SALT_A, SALT_B, None)} == {
        entry.key for entry in scheduler.allocator
    }
    assert _looks_up(scheduler, Item(H), None, "plain2"), "unsalted requests share"


def test_the_metadata_names_the_identifier_of_each_salted_key(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler()
    meta = StepDriver(scheduler).step([make_request("r", [Item(LORA)], cache_salt=SALT_A)]).meta
    key = _key(scheduler.tier_keys, LORA, SALT_A)
    assert list(meta.saves) == [key] and meta.identifiers == {key: LORA}
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    step = StepDriver(scheduler).step([make_request("r2", [Item(LORA)], cache_salt=SALT_A)])
    assert list(step.meta.loads) == [key] and step.meta.identifiers == {key: LORA}
    plain = StepDriver(scheduler).step([make_request("p", [Item("other")])]).meta
    assert list(plain.saves) == ["other"] and plain.identifiers == {}, "nothing to translate"


def test_lookups_in_vllms_order_resolve_through_the_request_ensured_last(
    make_scheduler: SchedulerFactory,
) -> None:
    """vLLM's scheduler, per request: `ensure_cache_available(request)`, then
    `has_cache_item(identifier)` for its items. Two requests with the same item and
    different salts, one step: each lookup answers for its own request's salt."""
    scheduler = make_scheduler()
    _save(scheduler, [Item(H)], SALT_A)
    ra = make_request("ra", [Item(H)], cache_salt=SALT_A)
    rb = make_request("rb", [Item(H)], cache_salt=SALT_B)
    assert scheduler.ensure_cache_available(rb, 0)
    assert not scheduler.has_cache_item(H), "B's key holds nothing"
    assert scheduler.ensure_cache_available(ra, 0)
    assert scheduler.has_cache_item(H), "A's entry, promised"
    assert scheduler.ensure_cache_available(rb, 0)
    assert not scheduler.has_cache_item(H), "B again after A: still B's key"
    scheduler.ensure_cache_available(ra, 0)
    scheduler.update_state_after_alloc(ra, 0)
    meta = scheduler.build_connector_meta(scheduler_output())
    assert list(meta.loads) == [_key(scheduler.tier_keys, H, SALT_A)]


def test_a_lookup_vllm_did_not_announce_is_a_miss_while_isolating(
    make_scheduler: SchedulerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Fail closed: an identifier the last ensured request does not have (or no
    request ensured this step) is encoded, with a warning; isolation off needs no
    request."""
    for isolating in (True, False):
        scheduler = make_scheduler(ec_isolate_cache_salt=isolating)
        _save(scheduler, [Item(H)], None)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert scheduler.has_cache_item(H) is not isolating
        assert ("ensure_cache_available" in caplog.text) is isolating
        scheduler.build_connector_meta(scheduler_output())
        scheduler.ensure_cache_available(make_request("other", [Item("x")]), 0)
        assert scheduler.has_cache_item(H) is not isolating, "not that request's item"
        scheduler.ensure_cache_available(make_request("two", [Item("x"), Item("y")]), 0)
        assert scheduler.has_cache_item(H) is not isolating, "nor one of several"
        scheduler.ensure_cache_available(make_request("mine2", [Item("x"), Item(H)]), 0)
        assert scheduler.has_cache_item(H), "the second of its items"
        scheduler.build_connector_meta(scheduler_output())
        scheduler.build_connector_meta(scheduler_output())
        scheduler.ensure_cache_available(make_request("mine", [Item(H)]), 0)
        scheduler.build_connector_meta(scheduler_output())
        assert scheduler.has_cache_item(H) is not isolating, "ensured in an earlier step"


def test_with_isolation_off_every_salt_shares(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler(ec_isolate_cache_salt=False)
    assert _save(scheduler, [Item(H)], SALT_A) == [H]
    assert _looks_up(scheduler, Item(H), SALT_B, "b")
    assert _looks_up(scheduler, Item(H), None, "plain")


def test_a_salted_load_whose_item_the_step_frees_is_withdrawn(
    make_scheduler: SchedulerFactory,
) -> None:
    """`free_encoder_mm_hashes` names vLLM's identifiers: a salted load of a freed
    item that no scheduled request takes is taken back all the same."""
    scheduler = make_scheduler()
    _save(scheduler, [Item(H)], SALT_A)
    lookups = scheduler.counters.lookups
    request = make_request("gone", [Item(H)], cache_salt=SALT_A)
    assert scheduler.ensure_cache_available(request, 0) and scheduler.has_cache_item(H)
    scheduler.update_state_after_alloc(request, 0)
    output = scheduler_output()
    output.free_encoder_mm_hashes = [H]
    meta = scheduler.build_connector_meta(output)
    assert meta.loads == {} and meta.identifiers == {} and meta.runs == {}
    assert scheduler.counters.hits == 0 and scheduler.counters.lookups == lookups
    entry = scheduler.allocator.get(_key(scheduler.tier_keys, H, SALT_A))
    assert entry is not None and entry.pins == 0


def test_items_without_input_are_looked_for_under_their_salt(
    make_scheduler: SchedulerFactory,
) -> None:
    """An item given without its input (metadata only) is available only from its
    own salt's entry: another salt's request is found unavailable."""
    scheduler = make_scheduler()
    _save(scheduler, [Item(H)], SALT_A)

    def metadata_only(rid: str, salt: str) -> object:
        request = make_request(rid, [Item(H)], cache_salt=salt)
        request.mm_features[0].data = None
        return request

    assert scheduler.ensure_cache_available(metadata_only("a", SALT_A), 0)  # type: ignore[arg-type]
    assert not scheduler.ensure_cache_available(metadata_only("b", SALT_B), 0)  # type: ignore[arg-type]
    assert scheduler.take_unavailable_requests() == {"b"}


def test_handles_name_the_salted_keys(make_scheduler: SchedulerFactory) -> None:
    """What a remote source builds a request's handle from (`LocalEntries.item_keys`)."""
    scheduler = make_scheduler()
    request = make_request("r", [Item(H), Item(LORA)], cache_salt=SALT_B)
    local = scheduler._local_entries()
    assert local.item_keys(request) == scheduler.tier_keys.keys_of(request)
    assert all(SALT_MARK in key and SALT_B not in key for key in local.item_keys(request))


def test_the_salt_reaches_neither_the_logs_nor_the_stats(
    make_scheduler: SchedulerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Salted requests through saves, hits, misses, a stale entry, a full region and
    an unannounced lookup, everything logged at DEBUG: the salt string appears in no
    log record and no stat."""
    salts = [SALT_A, SALT_B]
    with caplog.at_level(logging.DEBUG):
        scheduler = make_scheduler(blocks=64)
        for salt in salts:
            _save(scheduler, [Item(H), Item(LORA)], salt)
            _looks_up(scheduler, Item(H), salt, f"hit-{salt}")
        # A reused UUID of another size: the stale entry is dropped, with a warning.
        stale = make_request("stale", [Item(H, embeds=4)], cache_salt=SALT_A)
        scheduler.ensure_cache_available(stale, 0)
        # Larger than the region: not saved, with a warning.
        StepDriver(scheduler).step([make_request("big", [Item("big", 100)], cache_salt=SALT_B)])
        scheduler.has_cache_item("never-announced")
        stats = scheduler.get_ec_connector_stats()
        totals = scheduler.stat_totals()
        scheduler.shutdown()
    text = caplog.text + repr(stats) + repr(totals) + repr(stats.data if stats else None)
    assert "EC CPU tier" in caplog.text, "the test saw the tier's log"
    assert scheduler.counters.stale_dropped == 1
    assert scheduler.counters.saves_skipped_oversize == 1
    for salt in salts:
        assert salt not in text
