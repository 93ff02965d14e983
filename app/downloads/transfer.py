"""The transfer loop: ranged GETs on the hub's resolve URLs into persistent partial files.

What the stock client (huggingface-hub 2.4.0) lacks and this adds: a partial file plus a JSON
sidecar that survive a crash or reboot, so the next run continues where the last stopped;
retries with exponential back-off on a reset connection, a timeout, 429 and 5xx; sha256 (LFS)
or git-blob sha1 (small files) verification, so same-size corrupt bytes are rejected; progress
events several times a second.

Layout inside the destination folder:
    <path>                           finished, verified files
    .rq-partial/<path>.part          bytes received so far
    .rq-partial/<path>.part.json     {size, sha256, blob_id, durable}: `durable` bytes are fsynced
    .rq-partial/done.json            files verified by an earlier run (size, sha256, mtime)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2

from ..units import parse_size, size
from . import hub
from .control import Control
from .errors import (
    ConnectionLostError,
    DiskFullError,
    DownloadError,
    GatedRepoError,
    IntegrityError,
    RepoNotFoundError,
    ServerError,
)
from .events import Callback, Meter

PARTIAL_DIR = ".rq-partial"
# A download stops while this much is still free, so that the library can record why.
LIBRARY_ROOM = 32 << 20
FREE_CHECK_EVERY = 8 << 20  # bytes written between two looks at the free space
SIDECAR_FORMAT = "rotaryquant-partial"
SIDECAR_VERSION = 1
CHUNK = 1 << 20  # 1 MiB reads: small enough for smooth progress, large enough to be cheap
GiB = 1 << 30
DEFAULT_RESERVE = 2 * GiB  # never fill a disk completely: the OS and swap need room


def disk_reserve() -> int:
    """Disk kept free by downloads and their checks: $ROTARYQUANT_DISK_RESERVE (e.g. 5GB), else
    DEFAULT_RESERVE. The download's check, the plan shown before it and the CLI use this one."""
    v = os.environ.get("ROTARYQUANT_DISK_RESERVE", "").strip()
    return parse_size(v) if v else DEFAULT_RESERVE


SMALL = 1 << 20  # files up to this size come first (hub.model_files orders them so)


@dataclass(frozen=True)
class DownloadedFile:
    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass
class _FileState:
    """One file in flight: bytes [0, offset) are in `part` and in `hashers`."""

    file: hub.RemoteFile
    part: Path
    side: Path
    offset: int
    hashers: _Hashers


class _Transient(Exception):
    """A failure worth retrying (reset, timeout, 429, 5xx); `retry_after` from the server,
    `status` the HTTP status when the hub answered (None: the connection failed)."""

    def __init__(self, msg: str, retry_after: float | None = None, status: int | None = None):
        super().__init__(msg)
        self.retry_after = retry_after
        self.status = status


# Module-level so tests can simulate a full disk.
def free_bytes(path: str | os.PathLike) -> int:
    p = Path(path)
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def gib(n: int) -> str:
    return size(n, 2)


class _Hashers:
    """sha256 of the content, plus the git blob sha1 that the hub lists for non-LFS files."""

    def __init__(self, size: int):
        self.sha256 = hashlib.sha256()
        self.sha1 = hashlib.sha1(b"blob %d\0" % size)

    def update(self, data) -> None:
        self.sha256.update(data)
        self.sha1.update(data)


def hash_file(
    path: Path, nbytes: int | None = None, file_size: int | None = None, chunk: int = 8 * CHUNK
) -> _Hashers:
    """Hash the first `nbytes` of `path` (all by default) of a file that will be `file_size` long
    (the git blob sha1 starts with the full size)."""
    nbytes = path.stat().st_size if nbytes is None else nbytes
    h = _Hashers(nbytes if file_size is None else file_size)
    left = nbytes
    with open(path, "rb") as f:
        while left > 0:
            b = f.read(min(chunk, left))
            if not b:
                break
            h.update(b)
            left -= len(b)
    return h


def _abort(r: httpx2.Response) -> None:
    """Stop a response from another thread. Closing a socket does not wake a thread blocked in
    recv() on it; shutting it down does."""
    stream = r.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Downloader:
    """Download the files of a `RepoListing` into `dest`, resuming what an earlier run left."""

    def __init__(
        self,
        listing: hub.RepoListing,
        dest: str | os.PathLike,
        *,
        files: list[hub.RemoteFile] | None = None,
        tok: str | None = None,
        control: Control | None = None,
        on_event: Callback | None = None,
        retries: int = 8,  # consecutive failed attempts without progress before giving up
        backoff: float = 0.5,  # first wait; doubles per failed attempt
        max_backoff: float = 60.0,
        reserve: int | None = None,  # disk left free beyond the download (None: disk_reserve())
        give_up_after: float = 60.0,  # seconds of failed attempts without progress before giving up
        timeout: float = 30.0,  # connect/read timeout: a stalled connection counts as lost
        fsync_every: int = 64 << 20,  # bytes between durable checkpoints of a partial file
        use_hf_cache: bool = True,
        progress_interval: float = 0.2,
    ):
        self.listing = listing
        self.files = list(
            files
            if files is not None
            else sorted(listing.files, key=lambda f: (f.size > SMALL, f.path))
        )
        self.dest = Path(dest)
        self.tok = tok
        self.control = control or Control()
        self.on_event = on_event
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.reserve = disk_reserve() if reserve is None else reserve
        self.timeout, self.fsync_every = timeout, fsync_every
        self.give_up_after = give_up_after
        self.use_hf_cache = use_hf_cache
        self.partial = self.dest / PARTIAL_DIR
        self.meter = Meter(
            listing.repo,
            sum(f.size for f in self.files),
            len(self.files),
            on_event,
            interval=progress_interval,
        )
        self.requests = 0  # GETs sent (tests and logs)
        # Called once the small files (config, tokenizer) are in, before the first large one:
        # the library checks there that the conversion will fit too.
        self.preflight: Callable[[], None] | None = None

    # -- bookkeeping -------------------------------------------------------------------------

    def _part(self, f: hub.RemoteFile) -> tuple[Path, Path]:
        part = self.partial / (f.path + ".part")
        return part, part.with_name(part.name + ".json")

    def _done_path(self) -> Path:
        return self.partial / "done.json"

    def _load_done(self) -> dict:
        try:
            d = json.loads(self._done_path().read_text())
            return d if isinstance(d, dict) else {}
        except (OSError, ValueError):
            return {}

    def _already_done(self, f: hub.RemoteFile, done: dict) -> str | None:
        """sha256 of a finished file that an earlier run verified and nobody touched since."""
        rec = done.get(f.path)
        final = self.dest / f.path
        if not rec or not final.exists():
            return None
        st = final.stat()
        same = (
            rec.get("size") == f.size == st.st_size
            and rec.get("mtime_ns") == st.st_mtime_ns
            and (f.sha256 is None or rec.get("sha256") == f.sha256)
            and rec.get("blob_id") == f.blob_id
        )
        return rec.get("sha256") if same else None

    def _sidecar_matches(self, f: hub.RemoteFile, side: Path) -> int:
        try:
            s = json.loads(side.read_text())
        except (OSError, ValueError):
            return 0
        ok = (
            isinstance(s, dict)
            and s.get("format") == SIDECAR_FORMAT
            and s.get("version") == SIDECAR_VERSION
            and s.get("size") == f.size
            and s.get("sha256") == f.sha256
            and s.get("blob_id") == f.blob_id
            and isinstance(s.get("durable"), int)
        )
        return max(0, min(s["durable"], f.size)) if ok else 0

    def _write_sidecar(self, f: hub.RemoteFile, side: Path, durable: int) -> None:
        _atomic_json(
            side,
            {
                "format": SIDECAR_FORMAT,
                "version": SIDECAR_VERSION,
                "repo": self.listing.repo,
                "commit": self.listing.commit,
                "path": f.path,
                "size": f.size,
                "sha256": f.sha256,
                "blob_id": f.blob_id,
                "durable": durable,
            },
        )

    def remaining_bytes(self) -> int:
        """Bytes still to fetch, counting what partial files and finished files already hold."""
        done = self._load_done()
        left = 0
        for f in self.files:
            if self._already_done(f, done):
                continue
            part, side = self._part(f)
            have = min(self._sidecar_matches(f, side), part.stat().st_size if part.exists() else 0)
            left += f.size - have
        return left

    def check_disk(self) -> int:
        """Raise DiskFullError if the rest of the download won't fit; returns the bytes left."""
        need = self.remaining_bytes()
        free = free_bytes(self.dest)
        if need + self.reserve > free:
            raise DiskFullError(
                f"not enough disk space for {self.listing.repo} in {self.dest}: needs {gib(need)} "
                f"more (+{gib(self.reserve)} kept free), {gib(free)} free"
            )
        return need

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> list[DownloadedFile]:
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true"):
            raise ConnectionLostError(f"cannot download {self.listing.repo}: HF_HUB_OFFLINE is set")
        if self.listing.gated and not self.tok:
            raise hub.gated_error(self.listing.repo)
        self.dest.mkdir(parents=True, exist_ok=True)
        self.partial.mkdir(exist_ok=True)
        left = self.check_disk()
        done = self._load_done()
        out: list[DownloadedFile] = []
        self.meter.floor = self.meter.total - left  # what earlier runs left counts from the start
        self.meter.emit(force=True)
        with httpx2.Client(follow_redirects=True, timeout=self.timeout) as client:
            self.client = client
            for f in self.files:
                self.control.check()
                if f.size > SMALL and self.preflight is not None:
                    pre, self.preflight = self.preflight, None
                    pre()
                sha = self._already_done(f, done)
                if sha is None:
                    sha = self._fetch(f)
                    st = (self.dest / f.path).stat()
                    done[f.path] = {
                        "size": f.size,
                        "sha256": sha,
                        "blob_id": f.blob_id,
                        "mtime_ns": st.st_mtime_ns,
                    }
                    _atomic_json(self._done_path(), done)
                else:
                    self.meter.start_file(f.path, f.size, f.size)
                self.meter.finish_file()
                out.append(DownloadedFile(f.path, f.size, sha))
        if self.preflight is not None:
            self.preflight()
        shutil.rmtree(self.partial, ignore_errors=True)
        self.meter.emit(force=True)
        return out

    def _fetch(self, f: hub.RemoteFile) -> str:
        """Bring one file into place, verified; returns its sha256."""
        part, side = self._part(f)
        part.parent.mkdir(parents=True, exist_ok=True)
        restarted = False
        while True:
            st = self._resume(f, part, side)
            self.meter.start_file(f.path, f.size, st.offset)
            self._transfer(st)
            ok, why = self._verify(f, st.hashers)
            if ok:
                break
            # Corrupt bytes: the partial is useless; try once more from zero, then give up.
            part.unlink(missing_ok=True)
            side.unlink(missing_ok=True)
            if restarted:
                raise IntegrityError(
                    f"{self.listing.repo}/{f.path}: downloaded twice and {why} both times; the "
                    "file was deleted (the hub or a proxy serves damaged data)"
                )
            restarted = True
        final = self.dest / f.path
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        side.unlink(missing_ok=True)
        _fsync_dir(final.parent)
        return st.hashers.sha256.hexdigest()

    def _verify(self, f: hub.RemoteFile, h: _Hashers) -> tuple[bool, str]:
        if f.sha256 is not None:
            got = h.sha256.hexdigest()
            if got != f.sha256:
                return False, f"its sha256 was {got[:12]}…, the hub says {f.sha256[:12]}…"
        elif f.blob_id is not None and len(f.blob_id) == 40:
            got = h.sha1.hexdigest()
            if got != f.blob_id:
                return False, f"its git sha1 was {got[:12]}…, the hub says {f.blob_id[:12]}…"
        return True, ""

    def _resume(self, f: hub.RemoteFile, part: Path, side: Path) -> _FileState:
        """Where to continue from, with the hashes of the bytes already there."""
        have = part.stat().st_size if part.exists() else 0
        durable = min(self._sidecar_matches(f, side), have)
        if durable == 0:
            with open(part, "wb"):
                pass
            self._write_sidecar(f, side, 0)
            return _FileState(f, part, side, 0, _Hashers(f.size))
        if have > durable:
            # Bytes after the last checkpoint may be garbage after a power cut: drop them.
            os.truncate(part, durable)
        return _FileState(f, part, side, durable, hash_file(part, durable, f.size))

    def _from_hf_cache(self, f: hub.RemoteFile, part: Path) -> bool:
        """Reuse a copy that huggingface-hub already has in its cache (then verified as usual)."""
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(self.listing.repo, f.path, revision=self.listing.commit)
        except Exception:
            return False
        if not isinstance(cached, str) or not os.path.isfile(cached):
            return False
        src = os.path.realpath(cached)
        if os.path.getsize(src) != f.size:
            return False
        part.unlink(missing_ok=True)
        try:
            os.link(src, part)  # same disk: no copy, no space
        except OSError:
            shutil.copyfile(src, part)
        return True

    def _transfer(self, st: _FileState) -> None:
        """Fetch bytes [st.offset, size) with retries."""
        f = st.file
        if st.offset == 0 and f.size > 0 and self.use_hf_cache and self._from_hf_cache(f, st.part):
            st.hashers = hash_file(st.part, f.size, f.size)
            st.offset = f.size
            self.meter.advance(f.size)
            return
        failures = 0
        stuck_since = None
        while st.offset < f.size:
            self.control.check()
            before = st.offset
            try:
                self._attempt(st)
            except _Transient as e:
                failures = 0 if st.offset > before else failures + 1
                now = time.monotonic()
                stuck_since = None if failures == 0 else stuck_since or now
                stuck = now - stuck_since if stuck_since is not None else 0.0
                if failures > self.retries or stuck >= self.give_up_after:
                    raise self._gave_up(f, st.offset, e, failures, stuck) from None
                wait = min(self.max_backoff, self.backoff * 2 ** max(0, failures - 1))
                if e.retry_after is not None:
                    wait = min(self.max_backoff, max(wait, e.retry_after))
                # never sleep past the time limit: the user hears of it when it is reached
                wait = min(wait, max(0.0, self.give_up_after - stuck))
                self.control.sleep(wait)

    def _gave_up(self, f, offset: int, e: _Transient, tries: int, stuck: float) -> DownloadError:
        where = f"{self.listing.repo}/{f.path}"
        kept = f"{gib(offset)} of {gib(f.size)} kept; run the download again to resume"
        if e.status is not None:  # the hub answered, with an error every time
            return ServerError(
                f"the hub answered {e.status} to every request for {where} ({tries} tries in "
                f"{stuck:.0f} s): the problem is on the hub's side, not your connection; try "
                f"again later ({kept})"
            )
        return ConnectionLostError(f"lost the connection while downloading {where} ({kept}): {e}")

    def _headers(self, offset: int) -> dict[str, str]:
        h = hub.request_headers(self.tok)
        if offset:
            h["Range"] = f"bytes={offset}-"
        # Resolve URLs are pinned to a commit, so bytes never change under a resumed Range.
        h["Accept-Encoding"] = "identity"
        return h

    def _attempt(self, st: _FileState) -> None:
        url = hub.file_url(self.listing.repo, self.listing.commit, st.file.path)
        self.requests += 1
        try:
            with self.client.stream("GET", url, headers=self._headers(st.offset)) as r:
                self.control.attach(lambda: _abort(r))
                try:
                    start = self._check_response(st.file, r, st.offset)
                    if start != st.offset:  # the server sent the whole file: begin again
                        st.hashers = _Hashers(st.file.size)
                        st.offset = start
                    self._receive(st, r)
                finally:
                    self.control.attach(None)
        except (DownloadError, _Transient):  # includes Paused and Cancelled
            raise
        except Exception as e:
            self.control.check()  # a pause that closed the socket is not a lost connection
            if isinstance(e, httpx2.TransportError | httpx2.StreamError):
                raise _Transient(f"{type(e).__name__}: {e}") from None
            raise

    def _check_response(self, f: hub.RemoteFile, r: httpx2.Response, offset: int) -> int:
        """Raise for a bad status; return the byte offset the body starts at."""
        s = r.status_code
        where = f"{self.listing.repo}/{f.path}"
        if s in (401, 403):
            code = r.headers.get("X-Error-Code", "")
            if code == "GatedRepo" or self.listing.gated:
                raise hub.gated_error(self.listing.repo, has_token=bool(self.tok))
            raise GatedRepoError(
                f"the hub refused {where} ({s}): a private repo needs a token with access "
                "(set HF_TOKEN or run `hf auth login`)"
            )
        if s == 404:
            if r.headers.get("X-Error-Code") in ("RepoNotFound", "RevisionNotFound"):
                raise RepoNotFoundError(
                    f"{self.listing.repo}@{self.listing.commit[:12]} is gone from the hub"
                )
            raise RepoNotFoundError(f"{where} is listed by the hub but its download answers 404")
        if s == 429 or s >= 500:
            ra = r.headers.get("Retry-After")
            try:
                retry_after = float(ra) if ra else None
            except ValueError:
                retry_after = None
            raise _Transient(f"the hub answered {s}", retry_after, s)
        if s == 200:
            return 0
        if s == 206:
            cr = r.headers.get("Content-Range", "")
            try:
                start = int(cr.split()[1].split("-")[0])
                total = int(cr.split("/")[1])
            except (IndexError, ValueError):
                raise _Transient(f"bad Content-Range {cr!r}") from None
            if total != f.size:
                raise DownloadError(
                    f"{where}: the hub lists {f.size} bytes but serves {total}; the listing is "
                    "stale, start the download again"
                )
            if start != offset:
                raise _Transient(f"asked for bytes from {offset}, got {start}")
            return start
        raise DownloadError(f"{where}: unexpected answer {s} from the hub")

    def _disk_full(self, f: hub.RemoteFile, offset: int) -> DiskFullError:
        """ "disk full: N more needed", N being what the rest of the download needs beyond
        what is free now (the reserve included)."""
        left = (
            f.size
            - offset
            + sum(
                x.size
                for x in self.files[self.files.index(f) + 1 :]
                if not (self.dest / x.path).exists()
            )
        )
        more = max(left + self.reserve - free_bytes(self.dest), f.size - offset)
        return DiskFullError(
            f"disk full: {gib(more)} more needed to finish {self.listing.repo} in {self.dest} "
            f"({f.path}: {gib(offset)} of {gib(f.size)} kept); free that much and resume"
        )

    def _receive(self, st: _FileState, r: httpx2.Response) -> None:
        f = st.file
        fd = os.open(st.part, os.O_WRONLY | os.O_CREAT)
        last_sync = st.offset
        since_check = 0
        try:
            os.ftruncate(fd, st.offset)
            os.lseek(fd, st.offset, os.SEEK_SET)
            # As received: a chunk still being buffered when the link drops would be lost.
            for chunk in r.iter_raw():
                self.control.check()
                if st.offset + len(chunk) > f.size:
                    chunk = chunk[: f.size - st.offset]  # extra bytes would fail the hash anyway
                try:
                    write_all(fd, chunk)
                except OSError as e:
                    os.ftruncate(fd, st.offset)  # drop a half-written chunk
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise self._disk_full(f, st.offset) from None
                    raise
                st.hashers.update(chunk)
                st.offset += len(chunk)
                since_check += len(chunk)
                if since_check >= FREE_CHECK_EVERY:
                    since_check = 0
                    if (
                        free_bytes(self.dest) < LIBRARY_ROOM
                    ):  # stop while the library can still write
                        raise self._disk_full(f, st.offset)
                self.meter.advance(st.offset, len(chunk))
                if st.offset - last_sync >= self.fsync_every:
                    os.fsync(fd)
                    self._write_sidecar(f, st.side, st.offset)
                    last_sync = st.offset
                if st.offset >= f.size:
                    break
        finally:
            # Whatever happened, what is written so far is kept for the next run.
            try:
                os.fsync(fd)
                self._write_sidecar(f, st.side, st.offset)
            except OSError:
                pass
            os.close(fd)
        if st.offset < f.size:
            raise _Transient(f"connection closed at byte {st.offset} of {f.size}")
