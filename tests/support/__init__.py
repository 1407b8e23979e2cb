"""Helpers the tests share (importable as ``support`` because tests/conftest.py's folder is on
``sys.path``): ``processes`` starts components as real processes, ``reference`` runs transformers'
greedy decoding, ``router_helpers`` builds router requests, ``transfer_common`` the block pools'
spec and seeds."""
