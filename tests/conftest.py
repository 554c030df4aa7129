"""The tooling lives under scripts/ (``patchtool``, the report
modules); tests import it from there, never the reverse."""

import sys
from pathlib import Path

SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
