"""Chaos tests import the runtime tests' helpers by name, as the runtime tests do."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "runtime"))
