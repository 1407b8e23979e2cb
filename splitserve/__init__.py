"""splitserve: disaggregated LLM serving (router → prefill pool → decode pool over gRPC).

This package is the public face: the command line (``splitserve ...``) and, as the pipeline
lands, the client SDK (``splitserve.client``).
"""

__version__ = "0.1.0"
