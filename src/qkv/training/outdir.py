"""The `qkv train --out` folder: claimed by one run at a time, never someone else's files.

A folder is a qkv run when it holds `.qkv-run.json` (written first, with the run's
settings) or a training checkpoint. `OutputFolder.claim` decides what a new run may do:

- an empty or new folder becomes a run;
- a folder with files that is not a qkv run is refused, unless `overwrite`, which replaces
  the files qkv writes and removes the model-folder files qkv would otherwise load beside
  them (generation_config.json, tokenizer_config.json, ...); other files are left alone;
- a run that saved a checkpoint is continued with `resume`, or started over with `overwrite`;
- a run that never saved a checkpoint (it crashed first) is started over, by a fresh run
  or by `resume` (with its recorded settings).

The claim is a lock: `.qkv-run.lock`, locked with flock(2) for the whole run and holding
the owner's pid. A second run gets one line naming that pid; the lock of a process that
died is released by the kernel, so its file is simply taken over. Temporary files left by
writes that were killed (qkv.util.atomic) are removed when the folder is claimed.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from qkv.util.atomic import atomic_write_text, remove_temporaries
from qkv.errors import QkvError
from qkv.models.hf.checkpoint import FOLDER_FILES
from qkv.models.hf.untrusted import read_json_object
from qkv.training.checkpoint import CHECKPOINT_NAME

RUN_NAME = ".qkv-run.json"
LOCK_NAME = ".qkv-run.lock"
RUN_FORMAT = "qkv-train-run/1"
# Files a run writes (besides the marker and the lock).
RUN_FILES = ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss.png", CHECKPOINT_NAME)


class OutputFolder:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None

    # -- the lock -----------------------------------------------------------------------

    def _lock(self) -> None:
        import fcntl

        lock = self.path / LOCK_NAME
        for _ in range(10):  # the file may be replaced under us by a run that just ended
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise QkvError(
                    f"{self.path} is in use by another qkv train ({_owner(lock)}); wait for it to end "
                    "or choose another --out"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(lock).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._lock_fd = fd
                return
            os.close(fd)
        raise QkvError(f"cannot lock {lock}: it keeps being replaced")

    def release(self) -> None:
        if self._lock_fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path / LOCK_NAME)
        os.close(self._lock_fd)  # closing releases the flock
        self._lock_fd = None

    def forget(self) -> None:
        """Undo a claim that found bad input before writing anything: the run record and the
        lock go, so a folder the claim created is empty again."""
        with contextlib.suppress(OSError):
            os.unlink(self.path / RUN_NAME)
        self.release()

    def note_model(self, model_config: dict[str, Any]) -> None:
        """Add the model the run builds to its record: its real vocabulary, which the
        settings' vocab_size (a BPE's target size) need not be."""
        marker = self.path / RUN_NAME
        data = read_json_object(marker) if marker.exists() else {"format": RUN_FORMAT, "settings": {}}
        data["model_config"] = model_config
        atomic_write_text(marker, json.dumps(data, indent=1) + "\n")

    # -- what the folder holds -----------------------------------------------------------

    def run_settings(self) -> dict[str, Any] | None:
        """The settings recorded when the run started, None when the folder holds no marker."""
        marker = self.path / RUN_NAME
        if not marker.exists():
            return None
        data = read_json_object(marker)
        if data.get("format") != RUN_FORMAT or not isinstance(data.get("settings"), dict):
            raise QkvError(f"{marker} is not a qkv run record; remove it or choose another --out")
        return data["settings"]

    def _entries(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.name != LOCK_NAME)

    def _remove(self, names: tuple[str, ...]) -> None:
        for name in names:
            path = self.path / name
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                raise QkvError(f"{path} is a folder where qkv writes a file; move it away")

    def _start(self, settings: dict[str, Any], *, clear: tuple[str, ...]) -> None:
        self._remove(clear)
        atomic_write_text(self.path / RUN_NAME, json.dumps({"format": RUN_FORMAT, "settings": settings}, indent=1) + "\n")

    # -- claiming ---------------------------------------------------------------------

    def claim(self, *, resume: bool, overwrite: bool, settings: dict[str, Any]) -> None:
        """Create, lock and check the folder for a run (see the module docstring)."""
        if resume and overwrite:
            raise QkvError("--resume continues a run and --overwrite starts one over; give one of them")
        if self.path.exists() and not self.path.is_dir():
            raise QkvError(f"--out {self.path} is a file; give a folder")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock()
        except OSError as error:
            raise QkvError(f"cannot write to --out {self.path} ({error.strerror}); choose a writable folder") from None
        try:
            self._check(resume=resume, overwrite=overwrite, settings=settings)
        except BaseException:
            self.release()
            raise

    def _check(self, *, resume: bool, overwrite: bool, settings: dict[str, Any]) -> None:
        remove_temporaries(self.path)
        has_checkpoint = (self.path / CHECKPOINT_NAME).exists()
        is_run = has_checkpoint or self.run_settings() is not None
        stray = tuple(n for n in FOLDER_FILES if n not in RUN_FILES)
        if resume:
            if not is_run:
                raise QkvError(
                    f"no training checkpoint at {self.path / CHECKPOINT_NAME}; run without --resume to start a new run"
                )
            return
        if overwrite:
            self._start(settings, clear=(*RUN_FILES, *stray))
            return
        entries = self._entries()
        if not entries:
            self._start(settings, clear=())
        elif is_run and not has_checkpoint:  # a run that ended before its first checkpoint
            self._start(settings, clear=RUN_FILES)
        elif is_run:
            raise QkvError(
                f"{self.path} already holds a training run; pass --resume to continue it, --overwrite to "
                "start it over, or choose another --out"
            )
        else:
            shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
            raise QkvError(
                f"{self.path} is not empty ({shown}) and holds no qkv training run; pass --overwrite to "
                "write the run into it anyway, or choose another --out"
            )


def _owner(lock: Path) -> str:
    try:
        text = lock.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "its lock is held"
