"""splitserve: disaggregated LLM serving (router → prefill pool → decode pool over gRPC).

This package is the public face: the client SDK (``splitserve.client``), the command line
(``splitserve ...``), the local cluster launcher and the per-process configs.
"""

__version__ = "0.1.0"
