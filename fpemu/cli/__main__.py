"""`python -m fpemu.cli`: the fpemu command line."""

import sys

from fpemu.cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn imports it as __mp_main__ (fpemu.emulate.isolated)
    sys.exit(main())
