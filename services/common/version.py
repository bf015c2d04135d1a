"""The version of the installed pdserve distribution: `pdserve --version` and the
router's GET /version tell the same one."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("pdserve")
except PackageNotFoundError:            # run from a source tree that was never installed
    VERSION = "unknown"
