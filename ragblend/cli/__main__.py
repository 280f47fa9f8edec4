"""``python -m ragblend.cli``: the ``ragblend`` command."""

import sys

from . import main

sys.exit(main())
