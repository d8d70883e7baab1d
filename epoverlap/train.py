"""`python -m epoverlap.train` (what torchrun runs): the training command, `epoverlap.cli.train`.

A signal is answered with one line from the first statement on (`cli.process_end`), before
the heavy imports, and the process exits as soon as the command returns."""

import os

from epoverlap.cli.process_end import exit_now, stop_at_once

if __name__ == "__main__":
    stop_at_once("epoverlap-train", printing=os.environ.get("LOCAL_RANK", "0") == "0")
    from epoverlap.cli.train import main
    exit_now(main())
