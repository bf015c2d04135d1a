"""`python -m services.bench ...`: the same as `pdserve bench ...`."""
import argparse
import sys

from services.bench.command import add_arguments, run
from services.common.flags import env_defaults

parser = argparse.ArgumentParser(prog="python -m services.bench")
add_arguments(parser)
env_defaults(parser)
sys.exit(run(parser.parse_args()))
