"""`python run.py [serve|synth|generate] ...` == the `rwkv-server` console script."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
