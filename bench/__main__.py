"""``python -m bench``: every performance comparison in one run (bench/suite.py)."""

import sys

from bench.suite import main

sys.exit(main())
