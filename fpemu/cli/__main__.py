"""`python -m fpemu.cli`: the fpemu command line."""

import sys

from fpemu.cli import main

sys.exit(main())
