"""`python -m minillm ...` is the `minillm` command (chapter 11 starts the server this way)."""

import sys

from minillm.cli import main

sys.exit(main())
