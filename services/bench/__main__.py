"""`python -m services.bench ...`: the same as `pdserve bench ...`."""
import sys

from services.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
