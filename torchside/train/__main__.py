"""`python -m torchside.train` (and torchrun's `-m torchside.train`)."""

import sys

from torchside.train.cli import main

if __name__ == "__main__":  # importing this module (pkgutil.walk_packages does) runs nothing
    sys.exit(main())
