"""``python -m kiln``: the same command line as the ``kiln`` script."""

import sys

from kiln.cli import main

sys.exit(main())
