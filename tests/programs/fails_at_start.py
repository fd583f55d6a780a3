"""A program with a bug of its own: it fails the same way every time it starts (an import that
cannot succeed, as a missing dependency does). ftharness must name the cause and stop after a
few tries instead of restarting it until its restart intensity gives up."""

from __future__ import annotations

import sys


def main() -> int:
    print("fails_at_start: importing the model code", flush=True)
    import model_code_that_is_not_installed  # noqa: F401  the bug

    return 0


if __name__ == "__main__":
    sys.exit(main())
