"""Shared peer secrets for tests, demos and benchmarks, given the ways an engine accepts.

An engine refuses `ec_peer_secret` in its config (vLLM would log it); it reads
`$EC_CPU_TIER_PEER_SECRET` or the file `ec_peer_secret_file` names. Engines of
one test process with different secrets each get a file.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_secret_file(path: str | os.PathLike[str], *secrets: str) -> str:
    """Write `secrets` (one a line) to `path`, readable by its owner only, atomically (a
    running engine never reads half a file); return the absolute path as text."""
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, "".join(f"{secret}\n" for secret in secrets).encode())
    finally:
        os.close(fd)
    os.chmod(staged, 0o600)  # whatever the umask
    os.replace(staged, target)
    return str(target)


def secret_keys(directory: str | os.PathLike[str], *secrets: str) -> dict[str, str]:
    """The `ec_connector_extra_config` entry naming a new secret file in `directory`
    that holds `secrets`."""
    name = f"peer-secret-{abs(hash(secrets)) % 10**8}"
    return {"ec_peer_secret_file": write_secret_file(Path(directory) / name, *secrets)}
