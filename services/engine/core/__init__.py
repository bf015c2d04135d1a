"""The engine's pure core, plain Python (no torch): the scheduler and its sequences, the
block pool and block manager, the prefix cache's hashing, and sampling parameters."""
