"""``python -m detection.native``: build the kernels, and say whether they work here."""

import sys

from detection.native.build import available, unavailable_reason

if __name__ == "__main__":
    print("available" if available() else f"unavailable: {unavailable_reason()}")
    sys.exit(0 if available() else 1)
