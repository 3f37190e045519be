"""Where things live under the data dir, and the tinker:// path scheme."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

# Segment of a tinker path -> checkpoint type (wire spec 2.8).
SEGMENT_TYPES = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# The data dir holds every tenant's weights and the registry: the server's user alone may
# read it. Files 0600, folders 0700 (the server also runs with umask 077, see `tuneloop serve`).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dirs(directory: Path, root: Path) -> None:
    """Create `directory` and every missing folder between `root` and it, each 0700.

    (`Path.mkdir(mode=..., parents=True)` gives the mode to the last folder only.)
    """
    missing = []
    for folder in (directory, *directory.parents):
        if folder == root or folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        folder.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        folder.chmod(PRIVATE_DIR_MODE)  # mkdir's mode passes through the umask


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


@dataclass(frozen=True)
class TinkerPath:
    training_run_id: str
    segment: str
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.training_run_id}/{self.segment}/{self.name}"

    @classmethod
    def parse(cls, path: str) -> TinkerPath:
        if not path.startswith("tinker://"):
            raise ValueError("must start with tinker://")
        parts = path.removeprefix("tinker://").split("/")
        if len(parts) != 3 or not all(parts):
            raise ValueError("must be tinker://<training_run_id>/<segment>/<name>")
        if parts[1] not in SEGMENT_TYPES:
            raise ValueError(f"segment must be one of {sorted(SEGMENT_TYPES)}")
        return cls(*parts)


class Layout:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def prepare(self) -> None:
        """Create the data dir (0700; an existing one is made 0700 too) and its checkpoints
        folder."""
        self.data_dir.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        self.data_dir.chmod(PRIVATE_DIR_MODE)
        make_private_dirs(self.data_dir / "checkpoints", self.data_dir)

    @property
    def keys_file(self) -> Path:
        return self.data_dir / "keys.json"

    @property
    def database_url(self) -> str:
        return f"sqlite:///{self.data_dir / 'registry.sqlite3'}"

    def checkpoint_dir(self, tenant: str, path: TinkerPath) -> Path:
        # Run ids hold ':'; a hash keeps directory names portable and of bounded length.
        run = hashlib.sha256(path.training_run_id.encode()).hexdigest()[:24]
        directory = self.data_dir / "checkpoints" / tenant / run / path.segment / path.name
        # Its parents now, private; the engine fills the folder itself (atomically).
        make_private_dirs(directory.parent, self.data_dir)
        return directory
