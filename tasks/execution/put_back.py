"""The put-back: a stage that does not finish leaves its outputs as its last good run left them (dvc.lock).

DVC deletes a stage's outputs (all but `persist` ones) before it runs the stage's command and writes dvc.lock only
when the command succeeds. So the stage process itself guards its run (`guarded_outputs`, which tasks/runner.py
wraps around every stage): `rlhf run`, `rlhf stage`, `dvc repro` and `dvc exp run` all get the same put-back.

- At the start, a journal (.dvc/tmp/rlhf-put-back/STAGE.json, flock-held while the stage process lives) names each
  output and its last good hash from dvc.lock, and keeps a copy of each `persist` output (DVC leaves those to the
  stage, which may change them).
- On success the journal goes, and each `cache: false` output (metrics JSON) is kept by its md5 (kept/STAGE/MD5):
  DVC's cache holds those only when its run cache saved the stage.
- On an exception, Ctrl-C or SIGTERM each output is put back: its last good version is materialized beside it from
  DVC's cache (or the kept copy) and renamed into place, so a kill at any moment leaves it whole (old or new) or
  absent, never half-written. An output with no last good (a first run, a new output) is removed. Further signals
  wait for the end, and a stopper (flows/dvc_repro.stop_stages) never SIGKILLs a put-back in progress
  (`in_progress`).
- DVC holds its repo lock and an rwlock on the outputs while the command runs, so the stage cannot run
  `dvc checkout`: the cache is read here (files/md5/XX/REST; a `.dir` object is a JSON list of {relpath, md5}).
- A process killed outright (SIGKILL, the OOM killer, a power cut) leaves its journal: the next run of the stage
  clears what it had begun, and flows/dvc_repro.py (the parent under `rlhf run`) finishes the put-back before and
  after each stage (`finish_abandoned`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tasks.execution.errors import VerdictFailed

FOLDER = Path(".dvc") / "tmp" / "rlhf-put-back"  # under the workspace root: journals, persist copies, kept copies
FICLONE = 0x40049409  # ioctl: a reflink (copy-on-write) copy, where the file system has them
_guarding: list[str] = []  # stages this process guards now (nested guards of one stage are one guard)


class PutBackError(RuntimeError):
    """An output whose last good version cannot be put back; the message names it and where it was looked for."""


@contextmanager
def guarded_outputs(stage: str, root: str | Path = ".", sigterm: bool = True) -> Iterator[None]:
    """Run the block as stage `stage`'s run: if it raises (Ctrl-C included, and SIGTERM unless `sigterm` is False),
    the stage's outputs are put back as dvc.lock records them before the exception goes on. A no-op outside a DVC
    repo or for a stage dvc.yaml does not have."""
    root, main = Path(root).resolve(), threading.current_thread() is threading.main_thread()
    deferred: list[int] = []  # a signal that comes while the journal is being written is acted on once it is
    held = {sig: signal.signal(sig, lambda signum, frame: deferred.append(signum))
            for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    journal = None
    try:
        outs = None if stage in _guarding else _stage_outs(root, stage)
        if outs is not None:
            journal = Journal(root, stage)
            journal.begin(outs)
            _guarding.append(stage)
    finally:
        for sig, handler in held.items():
            signal.signal(sig, _unwind if sig == signal.SIGTERM and sigterm and journal else handler)
    if deferred and journal is None:  # nothing guarded: the signal does what it did
        signal.raise_signal(deferred[0])
    try:
        if deferred:
            raise KeyboardInterrupt(signal.Signals(deferred[0]).name)
        yield
    except VerdictFailed:  # a check that finished and judged its inputs bad: its reports say why, and stay
        if journal is not None:
            journal.left_standing()
        raise
    except BaseException:
        if journal is not None:
            journal.put_back()
        raise
    else:
        if journal is not None:
            journal.succeeded()
    finally:
        if journal is not None:
            if main:
                signal.signal(signal.SIGTERM, held[signal.SIGTERM])
            _guarding.remove(stage)
            journal.close()


def put_back_missing(stage: str, root: str | Path = ".") -> list[str]:
    """Bring back those of stage `stage`'s outputs that are absent, as dvc.lock records them: what a stage refused
    before it began leaves under plain `dvc repro`, which deleted its outputs first (bad parameters). Outputs that
    are there are left as they are (a stage run by hand may have written newer ones). The outputs brought back."""
    root = Path(root).resolve()
    outs = None if stage in _guarding else _stage_outs(root, stage)
    missing = [out for out in outs or [] if out["kind"] != "persist" and out["oid"] is not None
               and not (root / out["path"]).exists()]
    journal = Journal(root, stage)
    if not missing or not journal.take():  # nothing to do, or a live run of the stage guards them
        journal.close()
        return []
    try:
        journal.record = {"stage": stage, "pid": os.getpid(), "state": "running", "outs": missing}
        journal.put_back()
    finally:
        journal.close()
    return [out["path"] for out in missing if (root / out["path"]).exists()]


def in_progress(root: str | Path) -> bool:
    """Whether a live stage process is putting outputs back in workspace `root` now (a stopper waits for it)."""
    folder = Path(root) / FOLDER
    for path in folder.glob("*.json") if folder.is_dir() else ():
        with suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("state") == "putting-back" and _held(path.with_suffix(".lock")):
                return True
    return False


def finish_abandoned(root: str | Path) -> list[str]:
    """Finish the put-back of every stage of workspace `root` whose process died without finishing its run (SIGKILL,
    a power cut); the stages finished. Journals of live processes are left to them."""
    folder, done = Path(root).resolve() / FOLDER, []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        journal = Journal(Path(root).resolve(), path.stem)
        if journal.take():
            try:
                journal.put_back()
                done.append(path.stem)
            finally:
                journal.close()
    return done


class Journal:
    """One stage's run in workspace `root`: its outputs and their last good hashes, and its state ("running",
    "putting-back") for the stopper and for whoever finishes an abandoned run."""

    def __init__(self, root: Path, stage: str):
        self.root, self.stage, self.fd = root, stage, None
        self.folder = root / FOLDER
        self.path = self.folder / f"{stage}.json"
        self.persisted = self.folder / f"{stage}.persist"  # copies of the persist outputs as the run found them
        self.kept = self.folder / "kept" / stage  # the cache: false outputs of the last good runs, by md5
        self.record: dict = {}

    def take(self) -> bool:
        """Hold this stage's lock; False when a live process holds it. Loads a journal left by a dead one."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.folder / f"{self.stage}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            return False
        with suppress(FileNotFoundError):
            self.record = json.loads(self.path.read_text())
        return True

    def begin(self, outs: list[dict]) -> None:
        if not self.take():
            raise RuntimeError(f"stage {self.stage} is already running in {self.root} (its lock "
                               f"{self.folder / (self.stage + '.lock')} is held): one run of a stage at a time")
        if self.record:  # a run of this stage that died: what it began goes, its persist outputs come back
            print(f"put-back: stage {self.stage}'s previous run died before its end; clearing what it left",
                  file=sys.stderr, flush=True)
            for i, out in enumerate(self.record["outs"]):
                _replace(self.root / out["path"], self._persisted(i) if out["kind"] == "persist" else None)
        shutil.rmtree(self.persisted, ignore_errors=True)
        for i, out in enumerate(outs):
            path = self.root / out["path"]
            if out["kind"] == "persist" and path.exists():
                _materialize_copy(path, self.persisted / str(i) / path.name)
        self._write({"stage": self.stage, "pid": os.getpid(), "state": "running", "outs": outs})

    def succeeded(self) -> None:
        for out in self.record["outs"]:
            path = self.root / out["path"]
            if out["kind"] == "uncached" and path.is_file():
                md5 = _md5(path)
                keep = {md5, out["oid"]}
                if not (self.kept / md5).is_file():
                    _materialize_copy(path, self.kept / md5)
                for old in self.kept.iterdir():
                    if old.name not in keep and not old.name.startswith("."):
                        old.unlink()
        self._end()

    def left_standing(self) -> None:
        """The run's outputs stay as it wrote them, whole (a check's verdict): only the journal goes."""
        print(f"put-back: stage {self.stage} finished with a failed check: its reports stay for you to read "
              "(dvc.lock still records its last good run, so the next run reruns it)", file=sys.stderr, flush=True)
        self._end()

    def put_back(self) -> None:
        """Each output as its last good run left it, atomically; signals wait until every one is back."""
        main = threading.current_thread() is threading.main_thread()
        noted = []

        def wait(signum, frame):
            if not noted:
                noted.append(signum)
                print(f"put-back: {signal.Signals(signum).name} received; stage {self.stage}'s outputs are being put "
                      "back, which finishes first", file=sys.stderr, flush=True)

        held = {sig: signal.signal(sig, wait) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if main else {}
        start = time.monotonic()
        try:
            self._write({**self.record, "state": "putting-back"})
            back, removed, lost = [], [], []
            for i, out in enumerate(self.record["outs"]):
                if out.get("done"):  # put back by an earlier try that was killed after it
                    continue
                try:
                    source = self._persisted(i) if out["kind"] == "persist" else self._last_good(out)
                except PutBackError as err:
                    source, lost = None, [*lost, str(err)]
                existed = _replace(self.root / out["path"], source)
                if source is not None:
                    back.append(out["path"])
                elif existed:
                    removed.append(out["path"])
                out["done"] = True
                self._write(self.record)
            self._end()
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)
        for line in lost:
            print(f"put-back: {line}", file=sys.stderr, flush=True)
        size = sum(_size(self.root / path) for path in back)
        said = [f"its outputs of the last good run (dvc.lock) are back ({', '.join(back)}: {size / 2**20:.1f} MiB "
                f"in {time.monotonic() - start:.1f} s)"] if back else []
        if removed:
            said.append(f"what it had begun of {', '.join(removed)} is removed (no good run of it to put back)")
        print(f"put-back: stage {self.stage} did not finish: {'; '.join(said) or 'it had written nothing'}",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None

    def _last_good(self, out: dict) -> Path | None:
        """Where the last good version of `out` is now (None: it has none); for a directory, a folder beside it."""
        if out["oid"] is None:
            return None
        cache, oid = Path(out["cache"]), out["oid"]
        in_cache = cache / oid[:2] / oid[2:]
        if oid.endswith(".dir"):
            return _tree(in_cache, cache, self.root / out["path"])
        kept = self.kept / oid
        for source in (kept, in_cache) if out["kind"] == "uncached" else (in_cache,):
            if source.is_file() and (out["kind"] == "cached" or _md5(source) == oid):
                return source
        raise PutBackError(f"{out['path']}: its last good version (md5 {oid}, dvc.lock) is neither in DVC's cache "
                           f"({in_cache}) nor kept ({kept}); left absent, the next run makes it again")

    def _persisted(self, i: int) -> Path | None:
        copy = self.persisted / str(i) / Path(self.record["outs"][i]["path"]).name
        return copy if copy.exists() else None

    def _write(self, record: dict) -> None:
        self.record = record
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.path)

    def _end(self) -> None:
        self.path.unlink(missing_ok=True)
        shutil.rmtree(self.persisted, ignore_errors=True)
        self.record = {**self.record, "state": "done"}


def _stage_outs(root: Path, stage: str) -> list[dict] | None:
    """Stage `stage`'s outputs: path (relative to root), kind (cached, uncached, persist), last good hash (dvc.lock)
    and the DVC cache folder of that hash; None outside a DVC repo or for a stage it does not have. Read through
    DVC's own loader, which takes no lock."""
    if not (root / ".dvc").is_dir() or not (root / "dvc.yaml").is_file():
        return None
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            [dvc_stage] = repo.stage.collect(f"{root / 'dvc.yaml'}:{stage}")  # whatever this process's cwd
            outs = []
            for out in dvc_stage.outs:
                info = out.hash_info
                odb = repo.cache.local if not info or info.name == "md5" else repo.cache.legacy
                outs.append({"path": os.path.relpath(out.fs_path, root),
                             "kind": "persist" if out.persist else "cached" if out.use_cache else "uncached",
                             "oid": info.value if info else None, "cache": odb.path})
            return outs
    except (DvcException, ValueError):  # not a stage of dvc.yaml (or not exactly one)
        return None


def _tree(listing: Path, cache: Path, target: Path) -> Path:
    """A directory output's last good version built from DVC's cache in a folder beside `target`."""
    if not listing.is_file():
        raise PutBackError(f"{target.name}: its last good version's listing ({listing.name}, dvc.lock) is not in "
                           f"DVC's cache ({cache}); left absent, the next run makes it again")
    building = _beside(target, "put-back")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    for entry in json.loads(listing.read_text()):
        source, dest = cache / entry["md5"][:2] / entry["md5"][2:], building / entry["relpath"]
        if building.resolve() not in dest.resolve().parents:
            raise PutBackError(f"{listing}: entry {entry['relpath']!r} is outside its folder; not put back")
        if not source.is_file():
            shutil.rmtree(building, ignore_errors=True)
            raise PutBackError(f"{target.name}/{entry['relpath']}: not in DVC's cache ({source}); the output is left "
                               "absent, the next run makes it again")
        _copy(source, dest)
    return building


def _replace(target: Path, source: Path | None) -> bool:
    """Put `source` (a file, or a folder built beside `target`) at `target`, or remove `target` when None: through
    renames, so a kill at any moment leaves `target` whole or absent. Leftovers of killed writes beside it go too.
    Whether `target` was there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    discard = _beside(target, "discard")
    if source is None:
        ready = None
    elif source.is_dir():
        ready = source if source.parent == target.parent else _materialize_copy(source, _beside(target, "put-back"))
    else:
        ready = _beside(target, "put-back")
        _copy(source, ready)
    present = target.exists() or target.is_symlink()
    if present and (ready is None or ready.is_dir() or (target.is_dir() and not target.is_symlink())):
        _remove(discard)
        os.replace(target, discard)  # out of the way in one step; deleted below, where a kill can only leave it
    if ready is not None:
        os.replace(ready, target)  # a file replaces a file in one step; a folder lands where nothing is
    _fsync(target.parent)
    for leftover in target.parent.glob(f".{target.name}.*"):  # ours, and atomic_path's of a killed write
        if leftover.name.endswith((".tmp", ".old", ".put-back", ".discard", ".copy")):
            _remove(leftover)
    return present


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _beside(target: Path, what: str) -> Path:
    return target.with_name(f".{target.name}.{what}")


def _materialize_copy(source: Path, dest: Path) -> Path:
    """A copy of file or folder `source` at `dest` (written beside, then renamed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        tmp = dest.with_name(f".{dest.name}.copy")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp, symlinks=True, copy_function=_copy)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    else:
        tmp = dest.with_name(f".{dest.name}.copy")
        _copy(source, tmp)
        os.replace(tmp, dest)
    return dest


def _copy(source: str | Path, dest: str | Path) -> None:
    """Copy a file's bytes, as a reflink where the file system has them, synced to disk (a power cut after the
    rename that follows leaves the whole file, not an empty one)."""
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(dest, "wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
        except OSError:  # no reflinks here (ext4, tmpfs): the kernel copies the bytes
            _sendfile(src, dst)
        os.fsync(dst.fileno())


def _sendfile(src, dst) -> None:
    size, offset = os.fstat(src.fileno()).st_size, 0
    while offset < size:
        sent = os.sendfile(dst.fileno(), src.fileno(), offset, min(size - offset, 1 << 30))
        if sent == 0:
            break
        offset += sent


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _held(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _unwind(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
