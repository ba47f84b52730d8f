"""One NIXL agent over this engine's region: peers read it, and it reads theirs.

Runs in the scheduler process, each agent used by one thread only (the
producer's server or the consumer's fetcher). NIXL is imported when an agent
is built, never when this module is imported. The lean CPU-capable install is
`nixl-cu12==1.5.1` with `--no-deps` (see the package README); its UCX backend
moves host memory between processes without any GPU library.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

Span = tuple[int, int]
"""`(address, nbytes)`: a contiguous byte range."""

NIXL_REQUIREMENT = (
    "NIXL 1.5.1: on a CUDA host `pip install ec-transfer-nixl[cu12]` (or [cu13]); on a "
    "CPU host `pip install --no-deps nixl-cu12==1.5.1` (it would pull a CUDA torch)"
)


def nixl_api() -> Any:
    """NIXL's Python API module, or ImportError saying what to install."""
    for module in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise ImportError(
        f"the EC CPU tier's cross-engine layer needs NIXL: install {NIXL_REQUIREMENT}"
    )


def paired_spans(local: Sequence[Span], remote: Sequence[Span]) -> Iterator[tuple[Span, Span]]:
    """Split two layouts of the same bytes into equal pieces: `(local, remote)` per piece.

    Both sides hold one entry's bytes in order over their own runs; a piece
    ends wherever either side's run ends. Raises ValueError if the totals differ.
    """
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise ValueError("the two sides hold different numbers of bytes")
    li = ri = 0
    l_off = r_off = 0
    while li < len(local) and ri < len(remote):
        l_addr, l_len = local[li]
        r_addr, r_len = remote[ri]
        size = min(l_len - l_off, r_len - r_off)
        if size > 0:
            yield (l_addr + l_off, size), (r_addr + r_off, size)
        l_off += size
        r_off += size
        if l_off == l_len:
            li, l_off = li + 1, 0
        if r_off == r_len:
            ri, r_off = ri + 1, 0


class RegionAgent:
    """A NIXL agent with this engine's region registered as DRAM.

    `read` copies from a peer's region into ours (one-sided: the peer's CPU
    does not copy); the peer learns of the end from the consumer's Release.
    """

    def __init__(self, name: str, base: int, nbytes: int) -> None:
        api = nixl_api()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        self._registration = self._agent.register_memory([(base, nbytes, 0, "")], "DRAM")
        self.name = name
        self.metadata: bytes = bytes(self._agent.get_agent_metadata())
        self._known: dict[str, str] = {}

    def know(self, agent: str, metadata: bytes) -> str:
        """Make a peer's agent known (once per agent name); the name to read from."""
        handle = self._known.get(agent)
        if handle is None:
            added = self._agent.add_remote_agent(metadata)
            handle = added.decode() if isinstance(added, bytes) else str(added)
            self._known[agent] = handle
        return handle

    def forget(self, agent: str) -> None:
        """Drop a peer's agent (it went away or restarted)."""
        handle = self._known.pop(agent, None)
        if handle is not None:
            with contextlib.suppress(Exception):  # a dead peer's agent may refuse
                self._agent.remove_remote_agent(handle)

    def read(self, peer: str, pieces: Sequence[tuple[Span, Span]], notify: bytes = b"") -> Any:
        """Start reading `pieces` (`(local, remote)` spans) from `peer`; the transfer handle.

        With an empty `notify` the peer is not notified, and the READ completes
        without waiting for the peer to poll NIXL (on the same host: one copy by
        this process).

        Raises only when nothing of the READ can still write: a READ whose post failed
        but that NIXL will not release (part of it may have been posted) is returned
        like any other, for the caller to watch until NIXL lets go of it."""
        local = self._agent.get_xfer_descs([(a, n, 0) for (a, n), _ in pieces], "DRAM")
        remote = self._agent.get_xfer_descs([(a, n, 0) for _, (a, n) in pieces], "DRAM")
        handle = self._agent.initialize_xfer("READ", local, remote, peer, notify)
        error: Exception | None = None
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:  # NIXL's bindings raise for a failed post
            state, error = "ERR", exc
        if state == "ERR" and self.release(handle):
            why = f": {error}" if error is not None else ""
            raise RuntimeError(f"NIXL refused the READ from {peer}{why}") from error
        return handle

    def state(self, handle: Any) -> str:
        """ "PROC" while the READ runs, then "DONE" or "ERR" (drives NIXL's progress)."""
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception:  # NIXL raises for a failed READ (e.g. the peer went away)
            return "ERR"

    def release(self, handle: Any) -> bool:
        """Free a transfer handle; False when NIXL refuses (the READ may still run)."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications peers sent since the last call, by agent name (drives progress)."""
        found = self._agent.get_new_notifs()
        return {str(k): [bytes(m) for m in v] for k, v in found.items()}

    def close(self) -> None:
        for agent in list(self._known):
            self.forget(agent)
        with contextlib.suppress(Exception):  # shutting down: nothing more to do with it
            self._agent.deregister_memory(self._registration)
