"""`python -m pytest` from the checkout: its top-level folders (kernels/, router/, ...) are not
import roots, so they shadow no installed package (tests/conftest.py)."""

import importlib.util
import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def test_the_checkout_is_not_an_import_root():
    assert all(Path(p or os.curdir).resolve() != CHECKOUT for p in sys.path)
    # transformers imports the hub's `kernels` package where it is installed: it must be that
    # one, never the checkout's kernels/ (splitserve.kernels).
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not Path(spec.origin or "/").is_relative_to(CHECKOUT / "kernels"), spec
    assert os.environ.get("PYTHONSAFEPATH") == "1"  # processes the tests start: the same
