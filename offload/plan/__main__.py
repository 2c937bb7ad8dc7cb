"""python -m offload.plan: the planner's command line (offload.plan.planner.main)."""

import sys

from offload.plan.planner import main

if __name__ == "__main__":
    sys.exit(main())
