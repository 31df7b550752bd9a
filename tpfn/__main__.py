"""``python -m tpfn explain ...``: the command line of ``tpfn.cli``."""

import sys

from tpfn.cli import main

if __name__ == "__main__":
    sys.exit(main())
