"""Benchmark scripts, run as ``python benchmarks/NAME.py``; tests import a few of them as
``benchmarks.NAME``. Their shared helper is ``benchmarks/common.py``, imported as ``common``: imported
as a package, this folder goes at the end of the path for that (after the standard library, which its
``codecs.py`` must not shadow)."""

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.append(str(Path(__file__).parent))
