"""`python -m epoverlap.train` (what torchrun runs): the training command, `training.main`."""

import sys

from epoverlap.training.main import main

if __name__ == "__main__":
    sys.exit(main())
