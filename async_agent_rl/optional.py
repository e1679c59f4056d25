"""Optional dependencies, imported on first use with an error that names the package to install."""

from __future__ import annotations

import importlib
from typing import Any


def import_optional(module: str, package: str, feature: str = "the dense retriever backend",
                    extra: str = "dense") -> Any:
    """``module``, imported on first use; an ``ImportError`` naming ``package`` and the project's ``extra`` if it is
    missing. faiss and sentence-transformers (the ``dense`` extra) are needed only by the dense backend."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{feature} needs the package {package!r} (pip install {package}, or the project's [{extra}] extra): {e}"
        ) from e
