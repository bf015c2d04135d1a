"""`pdserve bench`: a load generator for any OpenAI-compatible streaming endpoint.

A run's life: `workload` builds seeded prompts of exact token lengths -> `load` sends
them on a Poisson schedule and/or under a concurrency cap -> `client` streams each one
over HTTP and times its chunks into a `RequestRecord` -> `metrics` turns the records
into a `Summary` -> `report` prints it, writes JSON and compares runs; `plot` draws it.
"""
