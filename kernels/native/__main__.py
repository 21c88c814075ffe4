"""``python -m kernels.native``: build (or find) the native extension now and say whether its operations run here."""

from __future__ import annotations

import sys

from ._few_row import few_row_op, few_row_status
from ._softmax import causal_softmax_op, masked_softmax_op, softmax_op, softmax_status


def main() -> int:
    """Build or load the extension, check it, print the status; exit 0 either way (it is optional)."""
    few_row_op()
    print(f"kvtier few-row product: {few_row_status()}")
    softmax_op()
    # NOTE: the causal and masked rows check themselves on first use; a failure shows in the status.
    causal_softmax_op()
    masked_softmax_op()
    print(f"kvtier native softmax (CPU attention): {softmax_status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
