"""One live run per `out_dir`: an advisory lock on `<out_dir>/.run.lock`, held by rank 0.

The lock is `flock` on an open file, so the operating system releases it when the process
ends however it ends (a crash or SIGKILL leaves no stale lock). The file holds the
holder's pid and host, for the error message of a run that finds it taken. The holder
removes the file when it is done (one a killed run leaves behind is simply taken over),
and a run that wrote nothing (it failed before its first log line) also removes the
directories it created.
"""

import fcntl
import os
import socket
from pathlib import Path

from dobb.train.errors import RunError

LOCK_NAME = ".run.lock"  # not ".lock": bench.study keeps its own lock of that name


class OutDirLock:
    """Hold `<out_dir>/.run.lock` until `release()`; `RunError` if another live run holds it."""

    def __init__(self, out_dir: str | Path):
        self.out = Path(out_dir)
        self.path = self.out / LOCK_NAME
        missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
        self._created = missing  # innermost first: removed again if the run writes nothing
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(
                f"out_dir {str(self.out)!r} cannot be created ({e.strerror}: {e.filename}); "
                "choose an out_dir whose parents are directories you can write"
            ) from None
        while True:  # retry if the file was replaced between our open and our lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise RunError(
                    f"out_dir {str(self.out)!r} is in use by a live run ({holder}); wait for it "
                    "to finish (or stop it), or choose another out_dir"
                ) from None
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self, run_files: tuple[str, ...] = ()) -> None:
        """Remove the lock file and unlock; if none of `run_files` exists in `out_dir`, also
        remove the directories this lock created (nothing is left of a run that wrote
        nothing)."""
        if self._fd is None:
            return
        # unlinked while still locked: a run that opened it meanwhile fails to lock it, or
        # (locking it after we close) sees it is no longer the file at the path, and retries
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
        if not any((self.out / name).exists() for name in run_files):
            for directory in self._created:
                try:
                    directory.rmdir()
                except OSError:  # not empty (someone else's files) or already gone
                    break
