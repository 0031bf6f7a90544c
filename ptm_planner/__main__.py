import sys

from ptm_planner.cli import main

sys.exit(main())
