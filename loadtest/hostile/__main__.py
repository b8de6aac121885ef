"""python -m loadtest.hostile ... (the same as `python -m loadtest hostile ...`)."""
import sys

from loadtest.hostile.cli import main

sys.exit(main())
