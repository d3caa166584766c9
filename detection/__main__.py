"""``python -m detection …`` runs ``sdcguard train`` (see :mod:`detection.harness`)."""

import sys

from detection.harness import main

if __name__ == "__main__":
    sys.exit(main())
