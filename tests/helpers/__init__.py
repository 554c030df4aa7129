"""What the tests share that is not a fixture: plain modules, imported as modules
(``from tests.helpers import REPO_ROOT``), never through a ``conftest``.

:data:`REPO_ROOT` is the one definition of the repository's root for every test: a test file
that moves keeps naming the same directory.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS = REPO_ROOT / "tools"
