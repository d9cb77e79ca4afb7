"""``python -m bakeoff.cli``: the ``bakeoff`` command."""

import sys

from bakeoff.cli.main import main

sys.exit(main())
