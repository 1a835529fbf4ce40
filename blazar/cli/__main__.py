"""
C{python -m blazar.cli}: the C{blazar} command.
"""

import sys

from blazar.cli import main

sys.exit(main())
