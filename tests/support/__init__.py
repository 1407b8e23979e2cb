"""Helpers the tests share (importable as ``support`` because tests/conftest.py's folder is on
``sys.path``): ``processes`` starts components as real processes, ``reference`` runs transformers'
greedy decoding, ``router_helpers`` builds router requests, ``transfer_common`` the block pools'
spec and seeds, ``kv_pools`` deterministic pools and a sender process (benchmarks import it too,
with tests/ on ``sys.path``), ``paged_kv`` the kernels' NaN-poisoned paged batches, ``metrics``
the /metrics name checks, ``bench_schema`` docs/bench.md's JSON schema, ``pki`` test certificates
made with the openssl CLI, ``wiretap`` a recording TCP relay (what the wire carries)."""
