"""python -m offload.plan: the planner's command line (offload.plan.cli.main)."""

import sys

from offload.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
