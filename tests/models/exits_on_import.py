"""A script-style model file that exits when imported (argparse --help, a guard gone wrong)."""

import sys

sys.exit(3)
