"""``python -m cli``: the ``bakeoff`` command."""

import sys

from cli.main import main

sys.exit(main())
