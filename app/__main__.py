"""`python -m app` starts the desktop app (`python -m app.cli` is the command line)."""

import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()  # the frozen app re-enters here for the worker process
    from app.ui.main import main

    sys.exit(main())
