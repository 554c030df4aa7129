"""The tooling and the CPU runtime live under scripts/ (``patchtool``, ``cpu_runtime``, the report
modules); tests import them from there, never the reverse."""

import sys
from pathlib import Path

SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
