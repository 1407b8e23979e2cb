"""``splitserve bench``: a serving benchmark pointed at any deployment (docs/bench.md).

A splitserve router over gRPC or any OpenAI-compatible HTTP server (splitserve's own HTTP API,
vLLM, SGLang) under a seeded workload (``workloads``) arriving as a Poisson or gamma process or at
a fixed concurrency (``arrivals``, ``runner``); per-request timings (``targets``) become the
figures (``metrics``), a table and a JSON file (``report``) and PNG plots (``plots``), beside the
servers' KV usage scraped from their Prometheus metrics (``scrape``). ``cli`` is the command.
"""
