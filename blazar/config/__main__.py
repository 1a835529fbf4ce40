"""
C{python -m blazar.config --reference}: print the configuration reference
(L{blazar.config.reference}), as C{docs/config-reference.md} holds it.
"""

import sys

from blazar.config.reference import main

sys.exit(main(sys.argv[1:]))
