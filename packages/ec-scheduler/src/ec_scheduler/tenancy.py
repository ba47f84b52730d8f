"""Tier keys: the key an item's entry has in this tier, given vLLM's `cache_salt`.

Runs in the scheduler process. vLLM lets a deployment isolate tenants with a
per-request `cache_salt`; its own encoder cache keys items by identifier alone
(`MultiModalFeatureSpec.identifier`, with a LoRA prefix where one applies), and
so would this tier. Every place the scheduler keys the allocator, the policy,
a step's plan, a peer lookup or a handle uses an item's *tier key* instead:

  * without a salt (or with `ec_isolate_cache_salt` false): the identifier itself;
  * with salt S: `f"{identifier}|salt:{digest(S)}"`, `digest` being the 32 hex
    characters of BLAKE2b-128 of S, keyed with K and personalised `ec-salt-v1`.

K is derived once, at start-up: from the cross-engine secret when peers are
configured (`BLAKE2b(secret, person="ec-saltkey-v1")`), so engines that share a
secret agree on every key and a lookup, reply or handle names a salted item
by its digest with no change to the wire; without peers K is empty (the
digest never leaves the process).

Guarantees:
  * distinct salts never share a key (except with the probability of a
    128-bit collision), and a salted key never equals its unsalted one;
  * a request without a salt, or any request with isolation off, has keys
    equal to its identifiers: unsalted requests share among themselves as
    before, and the workers need no translation for them;
  * the key wraps whatever identifier vLLM gives, a LoRA-prefixed one included;
  * the salt itself is never written to the region, logged, counted or sent:
    only its digest is, inside keys; the one place holding it is the bounded
    in-process memo of digests (`TierKeys.digest`), beside vLLM's own request.

A tier key is not an identifier vLLM knows: the workers index vLLM's encoder
cache by identifier, so a step's metadata names the identifier of each
salted key (`ECCPUConnectorMetadata.identifiers`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

SALT_MARK = "|salt:"
"""What separates an identifier from the salt's digest in a salted key."""

DIGEST_HEX = 32
"""Hex characters of a salt's digest (BLAKE2b, 16 bytes)."""

MEMO_MAX = 4096
"""Salts whose digest is remembered (least recently used first out)."""

_PERSON_DIGEST = b"ec-salt-v1"
_PERSON_KEY = b"ec-saltkey-v1"


def salt_key(secret: str | None) -> bytes:
    """K, the key of every salt's digest: derived from the cross-engine `secret`, or
    empty without one (an unkeyed digest, which never leaves the process)."""
    if secret is None:
        return b""
    return hashlib.blake2b(secret.encode(), person=_PERSON_KEY).digest()


class TierKeys:
    """Computes tier keys (see the module) for one engine.

    `isolating`: whether salts make keys (the `ec_isolate_cache_salt` setting).
    `secret`: the cross-engine signing secret (`PeerSettings.secret`) when peers
    are configured, else None; read once here, so a secret rotated later does not
    change any key before the engine restarts.

    Not thread-safe (the memo): the scheduler calls it under its lock only.
    """

    __slots__ = ("_key", "_memo", "isolating")

    def __init__(self, *, isolating: bool, secret: str | None) -> None:
        self.isolating = isolating
        self._key = salt_key(secret)
        self._memo: OrderedDict[str, str] = OrderedDict()

    def digest(self, salt: str) -> str:
        """The 32 hex characters that stand for `salt` in keys (memoised, bounded)."""
        memo = self._memo
        digest = memo.get(salt)
        if digest is not None:
            memo.move_to_end(salt)
            return digest
        digest = hashlib.blake2b(
            salt.encode("utf-8", "surrogatepass"),
            key=self._key,
            digest_size=DIGEST_HEX // 2,
            person=_PERSON_DIGEST,
        ).hexdigest()
        memo[salt] = digest
        if len(memo) > MEMO_MAX:
            memo.popitem(last=False)
        return digest

    def suffix(self, request: Request) -> str:
        """What a request's identifiers get appended to make its keys: empty for a
        request without a salt or with isolation off."""
        if not self.isolating:
            return ""
        salt = getattr(request, "cache_salt", None)
        if not salt:
            # an empty salt is no salt, as in vLLM's prefix-cache hashes
            return ""
        return SALT_MARK + self.digest(salt)

    def key(self, request: Request, feature: MultiModalFeatureSpec) -> str:
        """The tier key of `feature`, an item of `request`."""
        suffix = self.suffix(request)
        return feature.identifier + suffix if suffix else feature.identifier

    def keys_of(self, request: Request) -> list[str]:
        """The tier keys of the request's items, in its items' order."""
        suffix = self.suffix(request)
        if not suffix:
            return [feature.identifier for feature in request.mm_features]
        return [feature.identifier + suffix for feature in request.mm_features]


def identifier_of(key: str) -> str:
    """The identifier a tier key wraps (for display and diagnostics).

    An identifier that itself ends like a salted key (a client-given UUID can be
    any text) is shortened too: the scheduler never parses keys to find an
    identifier, it records each one from vLLM's item (`StepPlan.identifiers`).
    """
    cut = len(key) - DIGEST_HEX - len(SALT_MARK)
    if cut >= 0 and key.startswith(SALT_MARK, cut):
        return key[:cut]
    return key
