"""`python -m epoverlap.train` (what torchrun runs): the training command, `epoverlap.cli.train`."""

import sys

from epoverlap.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
