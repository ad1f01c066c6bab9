"""Prints what a script sees of how it was started (tests/test_forked_scripts.py runs it both ways)."""
import os
import sys

print(os.path.basename(__file__), __name__, os.path.basename(sys.path[0]), [os.path.basename(a) for a in sys.argv])
