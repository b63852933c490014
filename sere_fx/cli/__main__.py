"""``python -m sere_fx.cli``: the ``sere-fx`` command."""

import sys

from sere_fx.cli import main

sys.exit(main())
