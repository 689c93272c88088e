"""``ctrain fetch``: models, tokenizers and data sets by hub name into the Hugging Face cache that jobs
mount (``slurm.hf_cache``, else ``$HF_HOME``), on a machine with internet (a login node), so that jobs
on compute nodes, which have none, run with the hub offline.

huggingface_hub does the downloading (a second ``ctrain fetch`` after an interrupted one keeps the
files it finished and downloads the rest; a progress bar per file; a gated model with the token already configured, ``HF_TOKEN`` or
``hf auth login``, which ctrain reads from nowhere and writes to nowhere). What each fetch resolved
to, the commit of the revision asked for, is recorded in :data:`RECORD` in the cache.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctrain import files
from ctrain.errors import ConfigError, CtrainError
from ctrain.train.hubrefs import HubRef, cached_commit

#: In the cache: what each ``ctrain fetch`` resolved (name, revision asked, commit, when).
RECORD = Path("ctrain-fetched.json")
MAX_RECORD_BYTES = 4 * 2**20
#: Seconds without a byte before a download is given up as stalled (CTRAIN_FETCH_STALL, unless set).
STALL_SECONDS = 60


class FetchError(CtrainError):
    """A repository that could not be fetched: one line saying why and what to do."""

    exit_code = 1


def hf_home(configured: Path | None) -> Path:
    """The Hugging Face cache jobs mount at /hf_home: slurm.hf_cache, else $HF_HOME, else
    ~/.cache/huggingface, as the sbatch library's CTRAIN_HF_CACHE default (a test holds them equal)."""
    if configured is not None:
        return configured
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")


def fetch(ref: HubRef, home: Path, *, progress: bool = True) -> str:
    """Download ``ref`` into ``home``'s hub cache (files an earlier try finished are kept); its commit.

    huggingface_hub runs in a child process, watched: its info requests have no timeout and a stalled
    file is retried for minutes, so a download during which no byte arrives for :func:`stall_seconds`
    is ended, with one line, instead of hanging."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ConfigError("HF_HUB_OFFLINE is set here: ctrain fetch downloads, so run it where the hub is reachable "
                          "(a login node) with HF_HUB_OFFLINE unset")  # fmt: skip
    stall = stall_seconds()
    context = multiprocessing.get_context("fork")
    answers = context.SimpleQueue()
    child = context.Process(target=_download, args=(ref, home, progress, stall, answers), daemon=True)
    child.start()
    folder, seen, moved = ref.folder(home / "hub"), (-1, -1), time.monotonic()
    try:
        while answers.empty():
            if not child.is_alive():
                child.join()
                if answers.empty():
                    raise FetchError(f"{ref.shown}: the download stopped (exit code {child.exitcode}); run the same "
                                     "ctrain fetch again to continue")  # fmt: skip
                break
            size = _bytes(folder)
            if size != seen:
                seen, moved = size, time.monotonic()
            elif time.monotonic() - moved > stall:
                raise FetchError(f"{ref.shown}: the hub stopped answering (no byte in {stall} s; "
                                 f"{os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'}): check the network, "
                                 "then run the same ctrain fetch again to continue")  # fmt: skip
            time.sleep(0.5)
        outcome, detail = answers.get()
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    if outcome != "ok":
        raise FetchError(_failure(ref, outcome, detail))
    record(home, ref, detail)
    return detail


def stall_seconds() -> int:
    """Seconds without a byte before a download is given up (CTRAIN_FETCH_STALL, else :data:`STALL_SECONDS`)."""
    raw = os.environ.get("CTRAIN_FETCH_STALL", "")
    if not raw:
        return STALL_SECONDS
    if not raw.isdigit() or not 1 <= int(raw) <= 86_400:
        raise ConfigError(f"CTRAIN_FETCH_STALL is {raw!r}: give whole seconds, 1 to 86400")
    return int(raw)


def _bytes(folder: Path) -> tuple[int, int]:
    """What a download has written so far: the sizes of the files under the repository's folder, and
    the newest change to one (a retry rewriting the same bytes is still bytes arriving)."""
    total = newest = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                found = os.lstat(os.path.join(root, name))
                total, newest = total + found.st_size, max(newest, found.st_mtime_ns)
    return total, newest


def _download(ref: HubRef, home: Path, progress: bool, stall: int, answers: Any) -> None:
    """The child: snapshot_download, its outcome as (kind, detail) on ``answers``."""
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(stall))
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(stall))
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if not progress:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from huggingface_hub import errors, snapshot_download
        from huggingface_hub.utils import logging

        logging.set_verbosity_error()  # its retries' warnings: the outcome is said once, by the parent
    except ImportError as exc:
        from ctrain.train.stack import install_line

        answers.put(("other", f"huggingface_hub does not import here: {_first(exc)}; install it: {install_line()}"))
        return
    kinds = [("gated", errors.GatedRepoError), ("revision", errors.RevisionNotFoundError),
             ("repo", errors.RepositoryNotFoundError), ("http", errors.HfHubHTTPError)]  # most specific first
    try:
        path = snapshot_download(ref.name, repo_type=ref.kind, revision=ref.revision, cache_dir=home / "hub")
        answers.put(("ok", Path(path).name))
    except Exception as exc:  # every outcome goes back to the parent, which says it in one line
        kind = next((k for k, cls in kinds if isinstance(exc, cls)), None)
        if kind is None:
            module = type(exc).__module__.split(".")[0]
            network = module.startswith(("httpx", "httpcore", "requests", "urllib3"))
            kind = "network" if network else "system" if isinstance(exc, OSError) else "other"
        answers.put((kind, f"{type(exc).__name__}: {_first(exc)}"))


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _failure(ref: HubRef, kind: str, detail: str) -> str:
    """The one line for a download that failed with ``kind`` (:func:`_download`)."""
    again = "then run the same ctrain fetch again to continue"
    if kind == "gated":
        return (f"{ref.shown} is gated: accept its terms on the hub, then give this machine your token (hf auth "
                f"login, or HF_TOKEN) and fetch again ({detail})")  # fmt: skip
    if kind == "revision":
        return f"{ref.shown}: the hub has no revision {ref.revision!r} of {ref.name} (a branch, tag or commit): check it"
    if kind == "repo":
        other = "a data set (datasets/ORG/NAME)" if ref.kind == "model" else "a model (ORG/NAME)"
        return (f"{ref.shown}: no such {ref.kind} on the hub (or it is private and this machine has no token for "
                f"it): check the name, or whether it is {other}")  # fmt: skip
    if kind == "network":
        return f"{ref.shown}: the connection to the hub failed ({detail}); check the network or HF_ENDPOINT, {again}"
    if kind == "system":
        return f"{ref.shown}: the download could not be written ({detail}): free space in the cache, {again}"
    return f"{ref.shown}: the download failed ({detail}); {again}"


def record(home: Path, ref: HubRef, commit: str) -> None:
    """Note in the cache's :data:`RECORD` which commit ``ref`` resolved to."""
    path = home / RECORD
    entries = read_record(home)
    entries[ref.shown.partition("@")[0]] = {"revision": ref.revision or "main", "commit": commit,
                                           "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    files.atomic_write_json(path, dict(sorted(entries.items())))


def read_record(home: Path) -> dict[str, dict[str, str]]:
    """The cache's record of fetches; empty when there is none."""
    path = home / RECORD
    if not path.is_file():
        return {}
    data = files.load_json_bounded(path, MAX_RECORD_BYTES, "ctrain fetch's record")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not ctrain fetch's record (a JSON object): remove it and fetch again")
    return {str(k): v for k, v in data.items() if isinstance(v, dict)}


def fetch_all(refs: list[HubRef], home: Path, emit: Callable[[str], None], *, progress: bool = True) -> None:
    """Fetch each ref not yet in the cache at its revision (a branch is asked again: it may have moved);
    says what each became."""
    for ref in refs:
        if ref.revision is not None and cached_commit(home / "hub", ref) == ref.revision:
            emit(f"{ref.shown}: in {home} already (commit {ref.revision})")
            continue
        commit = fetch(ref, home, progress=progress)
        emit(f"{ref.shown}: commit {commit} in {ref.folder(home / 'hub')}")


def refs_named(names: list[str], *, dataset: bool, revision: str | None, root: Path) -> list[HubRef]:
    """What ``ctrain fetch NAME...`` fetches: each hub name, and for each recipe file (a .yaml that
    exists) the hub names it names, read as a job would read them (from the project directory)."""
    from ctrain.train.hubrefs import parse, recipe_refs
    from ctrain.train.recipe import load_recipe

    refs: list[HubRef] = []
    for name in names:
        if name.endswith((".yaml", ".yml")):
            path = Path(name)
            if not path.is_file():
                raise ConfigError(f"recipe {name} does not exist: name a recipe file or a hub repository (ORG/NAME)")
            recipe = load_recipe(path.resolve())
            cwd = Path.cwd()
            os.chdir(root)
            try:
                refs += recipe_refs(recipe)
            finally:
                os.chdir(cwd)
        else:
            refs.append(parse(name, dataset=dataset, revision=revision, setting="fetch"))
    return list(dict.fromkeys(refs))
