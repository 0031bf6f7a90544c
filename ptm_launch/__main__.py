import sys

from ptm_launch.runner import main

sys.exit(main())
