"""Cross-package tests. tools/ scripts are imported as modules (tools/ is on sys.path here and
on mypy's path)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))
