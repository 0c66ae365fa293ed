"""What a resolved model reference is: the Checkpoint record, the shard list of a folder and the side files."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

from attnkit.errors import AttnkitError
from attnkit.io.jsonsafe import read_json_file

INDEX_NAME = "model.safetensors.index.json"
#: Files a command that runs the model needs besides weights.
SIDE_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template*",
]


@dataclass
class Checkpoint:
    """A resolved model reference. `weight_files` are safetensors shards (empty for GGUF/config)."""

    ref: str
    kind: str  # "folder" | "safetensors" | "gguf" | "config" | "hub"
    config: dict
    root: Path | None = None
    weight_files: list[Path] = field(default_factory=list)
    gguf_file: Path | None = None
    repo_id: str | None = None
    revision: str | None = None
    dequantized_from: Path | None = None  # the GGUF file a cached folder was made from (attnkit.io.gguf_load)

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")


def split_revision(ref: str) -> tuple[str, str | None]:
    repo, _, rev = ref.partition("@")
    return repo, rev or None


def read_index(index: Path) -> dict[str, str]:
    """The weight_map (tensor -> shard file name) of a model.safetensors.index.json."""
    doc = read_json_file(index, "index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise AttnkitError(f"{index}: corrupt index (no weight_map)")
    if not all(isinstance(v, str) for v in weight_map.values()):
        raise AttnkitError(f"{index}: corrupt index (weight_map values must be shard file names)")
    return weight_map


def inside(folder: Path, name: str, source: Path) -> Path:
    """`folder / name`, refused when `name` (from `source`) leaves the folder by '..', an absolute path or a
    symlink. Hub snapshots may link into their repo's blobs/ folder, as huggingface_hub lays them out."""
    rel = PurePosixPath(name)
    if not name or "\0" in name or "\\" in name or rel.is_absolute() or ".." in rel.parts:
        raise AttnkitError(f"{source}: file name {name!r} points outside the checkpoint folder")
    path = Path(folder) / rel
    try:
        root, real = Path(folder).resolve(), path.resolve()
    except (RuntimeError, OSError):  # Python raises RuntimeError for a symlink loop
        raise AttnkitError(f"{path}: a symlink loop") from None
    allowed = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        allowed.append(root.parent.parent / "blobs")
    if not any(real == a or a in real.parents for a in allowed):
        raise AttnkitError(f"{path}: links to {real}, outside the checkpoint folder; copy the file in instead")
    return path


def side_files(folder: Path) -> list[Path]:
    """The files of SIDE_FILES in a folder, config.json aside; refused when one links out of the folder or is a
    link that leads nowhere (dangling, or a loop)."""
    patterns = [p for p in SIDE_FILES if p != "config.json"]
    found = [f for f in sorted(Path(folder).iterdir()) if any(fnmatch(f.name, p) for p in patterns)]
    broken = next((f for f in found if f.is_symlink() and not f.exists()), None)
    if broken is not None:
        raise AttnkitError(f"{broken}: a symlink that leads nowhere (dangling, or a loop)")
    return [inside(folder, f.name, f) for f in found if f.is_file()]


def safetensors_files(folder: Path) -> list[Path]:
    """The shards of a folder: from the index when there is one, else every *.safetensors file."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists():
        files = [inside(folder, name, index) for name in sorted(set(read_index(index).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise AttnkitError(f"{index}: shard {missing[0]} is missing")
        return files
    return [inside(folder, f.name, folder) for f in sorted(folder.glob("*.safetensors"))]


def checkpoint_digest(ckpt: Checkpoint) -> str:
    """sha256 over config.json and every weight file's name, size and safetensors header (no tensor data): what
    identifies a checkpoint in manifests and caches, cheap whatever its size."""
    import hashlib
    import struct

    h = hashlib.sha256((Path(ckpt.root) / "config.json").read_bytes())
    for f in sorted(ckpt.weight_files):
        with open(f, "rb") as fh:
            raw = fh.read(8)
            header = fh.read(struct.unpack("<Q", raw)[0]) if len(raw) == 8 else b""
        h.update(f"{Path(f).name}|{Path(f).stat().st_size}|".encode() + header)
    return h.hexdigest()
