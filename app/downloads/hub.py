"""What a hub repo holds, through huggingface-hub's API, with the hub's errors made plain.

The endpoint and token follow huggingface-hub's conventions (HF_ENDPOINT, HF_TOKEN or the token
saved by `hf auth login`), read at call time so that a changed environment takes effect.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub import errors as hf_errors
from huggingface_hub.utils import build_hf_headers, get_token, validate_repo_id

from .errors import (
    ConnectionLostError,
    DownloadError,
    GatedRepoError,
    HubUnreachableError,
    RepoNotFoundError,
    RevisionNotFoundError,
    UnsafeFileNameError,
)

MAX_NAME_BYTES = 240  # the partial file adds ".part.json" within the file system's 255

DEFAULT_ENDPOINT = "https://huggingface.co"
LIBRARY_NAME = "rotaryquant"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token(explicit: str | None = None) -> str | None:
    """The token to send: an explicit one, else HF_TOKEN, else the one `hf auth login` saved."""
    return explicit or get_token()


def request_headers(tok: str | None) -> dict[str, str]:
    # token=False: never let the client pick up a token we did not choose (tests, explicit None).
    return build_hf_headers(token=tok or False, library_name=LIBRARY_NAME)


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None = None  # LFS files: the hub's content hash
    blob_id: str | None = None  # git blob sha1; of the content itself for non-LFS files

    def __post_init__(self):
        why = unsafe_name(self.path)
        if why:  # refused while listing: nothing is written, no library entry is made
            raise UnsafeFileNameError(
                f"the repo lists a file this app will not write: {printable(self.path)} ({why})"
            )
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"bad size {self.size!r} for {self.path}")

    @property
    def lfs(self) -> bool:
        return self.sha256 is not None


@dataclass(frozen=True)
class RepoListing:
    repo: str
    revision: str  # what was asked for (a branch, tag or commit)
    commit: str  # what it resolved to: downloads are pinned to it so a resume never mixes revisions
    files: tuple[RemoteFile, ...]
    gated: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> RemoteFile:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)


def check_repo_id(repo: str) -> None:
    try:
        validate_repo_id(repo)
    except hf_errors.HFValidationError as e:
        raise RepoNotFoundError(f"{repo!r} is not a hub repo id (expected owner/name): {e}") from e
    if "/" not in repo:
        raise RepoNotFoundError(f"{repo!r} is not a hub repo id (expected owner/name)")


def translate(e: BaseException, repo: str, revision: str | None = None) -> DownloadError:
    """Map huggingface-hub and transport errors to ours, with what the user can do."""
    if isinstance(e, DownloadError):
        return e
    if isinstance(e, hf_errors.GatedRepoError):
        return gated_error(repo)
    if isinstance(e, hf_errors.RevisionNotFoundError):
        return RevisionNotFoundError(f"{repo} has no revision {revision!r} on {endpoint()}")
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        return RepoNotFoundError(
            f"{repo} was not found on {endpoint()} (check the name; a private repo needs a token: "
            "set HF_TOKEN or run `hf auth login`)"
        )
    if isinstance(e, hf_errors.OfflineModeIsEnabled):
        return ConnectionLostError(f"cannot reach the hub for {repo}: HF_HUB_OFFLINE is set")
    if isinstance(e, hf_errors.HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return ConnectionLostError(f"the hub answered {status} for {repo}: {str(e).strip()[:300]}")
    if isinstance(e, httpx2.ConnectError | httpx2.ConnectTimeout | socket.gaierror):
        return unreachable_error(e)
    if isinstance(e, httpx2.TransportError | OSError):
        return ConnectionLostError(
            f"lost the connection to {endpoint()} while asking about {repo}: {e}"
        )
    return DownloadError(f"{repo}: {e}")


def unreachable_error(e: BaseException) -> HubUnreachableError:
    """No connection was ever made: say so, and what to check."""
    host = urlsplit(endpoint()).hostname or endpoint()
    return HubUnreachableError(
        f"the hub cannot be reached ({endpoint()}: {e}). Check that this computer is online, "
        f"that {host} resolves and is not blocked by a firewall or proxy (HTTPS_PROXY), or set "
        "HF_ENDPOINT to a mirror; then retry."
    )


def gated_error(repo: str, has_token: bool = False) -> GatedRepoError:
    base = f"{endpoint()}/{repo}"
    if has_token:
        return GatedRepoError(
            f"{repo} is gated and your token has no access yet: accept its terms at {base}"
        )
    return GatedRepoError(
        f"{repo} is gated: accept its terms at {base}, then set HF_TOKEN or run `hf auth login`"
    )


def repo_listing(
    repo: str,
    revision: str | None = None,
    tok: str | None = None,
    retries: int = 3,
    backoff: float = 1.0,
) -> RepoListing:
    """Files, sizes and hashes of `repo` at `revision` (default: main), before downloading."""
    check_repo_id(repo)
    api = HfApi(endpoint=endpoint(), library_name=LIBRARY_NAME)
    for attempt in range(retries + 1):
        try:
            info = api.model_info(repo, revision=revision, files_metadata=True, token=tok or False)
            break
        except (hf_errors.HfHubHTTPError, httpx2.TransportError) as e:
            # no connection at all (offline, DNS): said at once, with a Retry in the app
            transient = (
                isinstance(e, httpx2.TransportError)
                and not isinstance(e, httpx2.ConnectError)
                or (
                    not isinstance(e, httpx2.TransportError)
                    and e.response is not None
                    and e.response.status_code >= 500
                )
            )
            if isinstance(e, hf_errors.RepositoryNotFoundError | hf_errors.RevisionNotFoundError):
                transient = False
            if not transient or attempt == retries:
                raise translate(e, repo, revision) from e
            time.sleep(backoff * 2**attempt)
    files = []
    for s in info.siblings or []:
        if s.size is None:
            raise DownloadError(f"the hub gave no size for {repo}/{printable(s.rfilename)}")
        try:
            files.append(
                RemoteFile(s.rfilename, int(s.size), s.lfs.sha256 if s.lfs else None, s.blob_id)
            )
        except UnsafeFileNameError as e:
            raise UnsafeFileNameError(str(e).replace("the repo", repo, 1)) from None
    if not info.sha:
        raise DownloadError(f"the hub gave no commit for {repo}")
    return RepoListing(repo, revision or "main", info.sha, tuple(files), bool(info.gated))


def printable(name: str, limit: int = 120) -> str:
    """A hub-supplied name for a message: quoted, control characters (newlines, ANSI escapes)
    escaped, long names cut."""
    r = ascii(name) if any(ord(c) < 32 or ord(c) == 127 for c in name) else repr(name)
    return r if len(r) <= limit else r[: limit - 5] + "…" + r[-4:]


def unsafe_name(path: str) -> str | None:
    """Why a listed path cannot be written safely inside a model folder, or None."""
    if "\0" in path:
        return "a NUL byte"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "control characters"
    if path.startswith(("/", "\\")) or (len(path) > 1 and path[1] == ":"):
        return "an absolute path"
    parts = path.replace("\\", "/").split("/")
    if any(p in ("..", ".", "") for p in parts):
        return "a '..', '.' or empty path component"
    if any(len(p.encode()) > MAX_NAME_BYTES for p in parts):
        return f"a name over {MAX_NAME_BYTES} bytes"
    return None


def repo_files(repo: str, revision: str | None = None, tok: str | None = None):
    """[(path, size, sha256 or None)] of a repo, for showing before a download."""
    listing = repo_listing(repo, revision, token(tok))
    return [(f.path, f.size, f.sha256) for f in listing.files]


def file_url(repo: str, commit: str, path: str) -> str:
    return hf_hub_url(repo, path, revision=commit, endpoint=endpoint())


# What a model folder needs; the rest of a repo (original checkpoints, other formats, images)
# is left on the hub. gpt-oss, for one, also ships `original/` and `metal/` copies of its weights.
_WANTED_SUFFIXES = (
    ".json",
    ".safetensors",
    ".txt",
    ".model",
    ".tiktoken",
    ".jinja",
    ".md",
)  # never *.py: custom code is not run, so it is not fetched either
_WEIGHT_FALLBACKS = (".bin", ".pt", ".pth", ".gguf")


def model_files(listing: RepoListing) -> list[RemoteFile]:
    """The files a model folder needs: top-level configs, tokenizer, safetensors weights (other
    weight formats only when the repo has no safetensors). Small files first, so config.json is
    in place early."""
    top = [f for f in listing.files if "/" not in f.path and not f.path.startswith(".")]
    has_st = any(f.path.endswith(".safetensors") for f in top)
    chosen = [
        f
        for f in top
        if f.path.endswith(_WANTED_SUFFIXES)
        or (not has_st and f.path.endswith(_WEIGHT_FALLBACKS))
        or f.path in ("LICENSE", "NOTICE", "USE_POLICY")
    ]
    return sorted(chosen, key=lambda f: (f.size > 1 << 20, f.path))
