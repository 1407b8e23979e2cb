"""The router process never loads torch.

The router runs no model: it tokenizes (transformers' tokenizers over the ``tokenizers`` library),
renders chat templates and hashes prompt blocks, all of which work without torch — transformers
supports installs without it ("only tokenizers, configuration and file/data utilities"). But
transformers imports torch whenever it finds it installed, which was most of a router's start
(seconds on a small machine) and memory. ``keep_torch_out`` makes ``import torch`` fail in this
process (``sys.modules["torch"] = None``, Python's documented way to block an import), so
transformers takes its torch-less path; the tokens are the same (tests/cluster/
test_router_no_torch.py compares them with a tokenizer loaded beside torch).
"""

from __future__ import annotations

import sys

import splitserve.settings as settings


def keep_torch_out() -> bool:
    """Block torch in this process unless it is already imported or ``$SPLITSERVE_ROUTER_TORCH``
    is 1; True when blocked. Call before anything imports transformers."""
    if "torch" in sys.modules or settings.ROUTER_TORCH.get():
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # import torch: ModuleNotFoundError
    # transformers' one advisory at import ("PyTorch was not found ...") is expected here.
    settings.TRANSFORMERS_NO_ADVISORY_WARNINGS.set_default("1")
    return True
