"""``python -m harness`` is ``ftharness``."""

import sys

from harness.cli import main

sys.exit(main())
