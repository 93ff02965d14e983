"""Errors of the download and library layer: each says what failed and what the user can do."""

from __future__ import annotations

from app.engine.errors import EngineError


class DownloadError(EngineError):
    """A download failed; `resumable` says whether running it again continues where it stopped."""

    resumable = True


class RepoNotFoundError(DownloadError):
    resumable = False


class RevisionNotFoundError(DownloadError):
    resumable = False


class GatedRepoError(DownloadError):
    resumable = False


class DiskFullError(DownloadError):
    pass


class ConnectionLostError(DownloadError):
    pass


class UnsafeFileNameError(DownloadError):
    """The repo lists a file name that would escape or break the model folder."""

    resumable = False


class UnsupportedModelError(DownloadError):
    """The model needs code the app never runs (custom code) and mlx-lm has no module for it."""

    resumable = False


class HubUnreachableError(ConnectionLostError):
    """No connection to the hub could be made at all (offline, DNS, refused, proxy)."""


class ServerError(DownloadError):
    """The hub answered with an error (5xx, 429) to every try."""


class IntegrityError(DownloadError):
    """A file's bytes do not match the hub's hash or size (it was deleted, not kept)."""


class Paused(DownloadError):
    """Raised out of a transfer that was paused; the partial files are kept."""


class Cancelled(DownloadError):
    """Raised out of a transfer that was cancelled."""

    resumable = False


class LibraryError(EngineError):
    """A library operation failed (unknown name, wrong state, damaged store)."""


class LibraryDiskFull(LibraryError):
    """The library's database could not be written: the disk is full."""
