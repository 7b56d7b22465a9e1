"""pytest configuration: the helpers beside this file (naive.py, problems.py) are importable."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
