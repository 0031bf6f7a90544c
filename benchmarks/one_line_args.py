"""argparse for the GPU check's programs: a usage error is one line (``prog: error: message``) and exit status 2,
so gpu_check.sh's summary can quote it whole."""
from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
