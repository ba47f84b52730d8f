"""Where this checkout is: ec-testing is only ever used from the repository it lives in.

Guarantees: `ROOT` is the repository root (the folder holding `packages/` and
`tools/`), since this package is installed editable from
`packages/ec-testing/src` and never built into a wheel that leaves the checkout.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
"""The repository root."""
