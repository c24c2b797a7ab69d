"""The storage a Ray cluster's nodes share with the stage's driver: a path every node mounts, or an S3 prefix.

A stage run on Ray gets a folder of its own there (`RunFolder`): the driver puts the stage's inputs in, each rank
copies them to a scratch workspace on its node, rank 0 puts the outputs back, and the driver lands them in the DVC
workspace. Everything goes through `pyarrow.fs` (what Ray Train's own storage uses): a local path and
`s3://bucket/prefix` (credentials and endpoint from the environment, AWS_ENDPOINT_URL for a local S3) alike.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

STORAGE_ENV = "RLHF_RAY_STORAGE"


def is_remote(uri: str) -> bool:
    return "://" in uri


class RunFolder:
    """One folder of the shared storage (`uri`: an absolute path or s3://bucket/prefix/...)."""

    def __init__(self, uri: str):
        from pyarrow import fs

        self.uri = uri.rstrip("/")
        if is_remote(self.uri):
            self.fs, self.base = fs.FileSystem.from_uri(self.uri)
        else:
            self.fs, self.base = fs.LocalFileSystem(), str(Path(self.uri).resolve())
        self._local = fs.LocalFileSystem()

    def path(self, relative: str = "") -> str:
        return str(PurePosixPath(self.base, relative)) if relative else self.base

    def child(self, relative: str) -> RunFolder:
        return RunFolder(f"{self.uri}/{relative}")

    def put(self, root: Path, relative_paths: Iterable[str], under: str) -> None:
        """Copy each file or folder `root/relative` to `under/relative`."""
        for relative in relative_paths:
            source = root / relative
            files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
            for file in files:
                self._copy(self._local, str(file), self.fs, self.path(f"{under}/{file.relative_to(root).as_posix()}"))

    def get(self, under: str, root: Path) -> list[str]:
        """Copy the folder `under` into `root` (merged with what is there); the files it held, relative to it."""
        files = self.files(under)
        for relative in files:
            self._copy(self.fs, self.path(f"{under}/{relative}"), self._local, str(root / relative))
        return files

    @staticmethod
    def _copy(source_fs, source: str, target_fs, target: str) -> None:
        from pyarrow import fs

        target_fs.create_dir(str(PurePosixPath(target).parent), recursive=True)
        fs.copy_files(source, target, source_filesystem=source_fs, destination_filesystem=target_fs)

    def files(self, under: str) -> list[str]:
        """Every file below `under`, relative to it."""
        from pyarrow import fs

        source = self.path(under)
        if self.fs.get_file_info(source).type != fs.FileType.Directory:
            return []
        infos = self.fs.get_file_info(fs.FileSelector(source, recursive=True))
        return sorted(str(PurePosixPath(i.path).relative_to(source)) for i in infos if i.type == fs.FileType.File)

    def folders(self, under: str = "") -> list[str]:
        """The names of the folders directly below `under`."""
        from pyarrow import fs

        source = self.path(under)
        if self.fs.get_file_info(source).type != fs.FileType.Directory:
            return []
        return sorted(i.base_name for i in self.fs.get_file_info(fs.FileSelector(source)) if i.type == fs.FileType.Directory)

    def write_json(self, relative: str, value) -> None:
        target = self.path(relative)
        self.fs.create_dir(str(PurePosixPath(target).parent), recursive=True)
        with self.fs.open_output_stream(target) as out:
            out.write(json.dumps(value, indent=2, sort_keys=True).encode())

    def read_json(self, relative: str):
        """The JSON value at `relative`, None when there is none."""
        from pyarrow import fs

        target = self.path(relative)
        if self.fs.get_file_info(target).type != fs.FileType.File:
            return None
        with self.fs.open_input_stream(target) as stream:
            return json.loads(stream.read())

    def remove(self) -> None:
        from pyarrow import fs

        if self.fs.get_file_info(self.base).type != fs.FileType.NotFound:
            self.fs.delete_dir(self.base)


def land(incoming: Path, root: Path, relative_paths: Iterable[str]) -> None:
    """Move each `incoming/relative` to `root/relative`, replacing what was there: the new copy is whole before it
    takes the old one's place (a rename on the same disk), so no reader ever sees half of either."""
    for relative in relative_paths:
        source, target = incoming / relative, root / relative
        if not source.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{target.name}.landing")
        _remove(staged)
        shutil.move(str(source), staged)  # onto the workspace's disk first (incoming may be elsewhere)
        old = target.with_name(f".{target.name}.replaced")
        _remove(old)
        if target.exists() or target.is_symlink():
            os.replace(target, old)
        os.replace(staged, target)
        _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
