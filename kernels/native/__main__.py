"""``python -m kernels.native``: build (or find) the few-row extension now and say whether it runs here."""

from __future__ import annotations

import sys

from ._few_row import few_row_op, few_row_status


def main() -> int:
    """Build or load the extension, check it, print the status; exit 0 either way (it is optional)."""
    few_row_op()
    print(f"kvtier few-row product: {few_row_status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
