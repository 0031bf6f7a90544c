import sys

from zero_cache.launcher.runner import main

sys.exit(main())
