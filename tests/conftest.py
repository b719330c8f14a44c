import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import hypothesis_budget  # noqa: E402,F401  (registers and loads the hypothesis profiles)
