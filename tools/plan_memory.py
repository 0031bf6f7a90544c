"""Memory planner: does a GPT fit this hardware under zero_cache ZeRO-3 (the command line of ptm_planner.cli).

    python tools/plan_memory.py --size 1.3b --nproc-per-node 8 --bf16 --device cuda
    python tools/plan_memory.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --largest

Exit status: 0 fits, 3 does not fit, 2 bad input.
"""
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ptm_planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
