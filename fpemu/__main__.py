"""``python -m fpemu``: the same command line as the ``fpemu`` script."""

import sys

from fpemu.cli import main

sys.exit(main())
