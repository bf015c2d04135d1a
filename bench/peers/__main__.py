import sys

from bench.peers.command import main

sys.exit(main())
