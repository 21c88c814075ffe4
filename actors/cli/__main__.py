"""``python -m actors.cli``: the ``kvtier`` command without the console script."""

from __future__ import annotations

import sys

from .main import main

sys.exit(main())
