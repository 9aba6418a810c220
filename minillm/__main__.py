"""`python -m minillm ...` is the `minillm` command (chapter 11 starts the server this way)."""

import sys

from minillm.cli import main

if __name__ == "__main__":  # a spawned worker process re-imports this module as __mp_main__
    sys.exit(main())
