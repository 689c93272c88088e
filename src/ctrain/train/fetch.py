"""``ctrain fetch``: models, tokenizers and data sets by hub name into the Hugging Face cache that jobs
mount (``slurm.hf_cache``, else ``$HF_HOME``), on a machine with internet (a login node), so that jobs
on compute nodes, which have none, run with the hub offline.

huggingface_hub does the downloading (resumable: a second ``ctrain fetch`` continues an interrupted
file; a progress bar per file; a gated model with the token already configured, ``HF_TOKEN`` or
``hf auth login``, which ctrain reads from nowhere and writes to nowhere). What each fetch resolved
to, the commit of the revision asked for, is recorded in :data:`RECORD` in the cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ctrain import files
from ctrain.errors import ConfigError, CtrainError
from ctrain.train.hubrefs import HubRef, cached_commit

#: In the cache: what each ``ctrain fetch`` resolved (name, revision asked, commit, when).
RECORD = Path("ctrain-fetched.json")
MAX_RECORD_BYTES = 4 * 2**20
#: Seconds without a byte before a download is given up as stalled (HF_HUB_DOWNLOAD_TIMEOUT, unless set).
STALL_SECONDS = 30


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
    """Download ``ref`` into ``home``'s hub cache (continuing what an earlier try left); its commit."""
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(STALL_SECONDS))
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ConfigError("HF_HUB_OFFLINE is set here: ctrain fetch downloads, so run it where the hub is reachable "
                          "(a login node) with HF_HUB_OFFLINE unset")  # fmt: skip
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from huggingface_hub import errors, snapshot_download

    try:
        path = snapshot_download(ref.name, repo_type=ref.kind, revision=ref.revision, cache_dir=home / "hub",
                                 etag_timeout=STALL_SECONDS)  # fmt: skip
    except errors.GatedRepoError as exc:
        raise FetchError(f"{ref.shown} is gated: accept its terms on the hub, then give this machine your token "
                         f"(hf auth login, or HF_TOKEN) and fetch again ({_first(exc)})") from exc  # fmt: skip
    except errors.RevisionNotFoundError as exc:
        raise FetchError(f"{ref.shown}: the hub has no revision {ref.revision!r} (a branch, tag or commit of "
                         f"{ref.name}): check its name ({_first(exc)})") from exc  # fmt: skip
    except errors.RepositoryNotFoundError as exc:
        kinds = "a data set (datasets/ORG/NAME)" if ref.kind == "model" else "a model (ORG/NAME)"
        raise FetchError(f"{ref.shown}: no such {ref.kind} on the hub (or it is private and this machine has no "
                         f"token for it); check the name, or whether it is {kinds}") from exc  # fmt: skip
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        raise FetchError(f"{ref.shown}: the download failed: {_first(exc)}; run the same ctrain fetch again to "
                         "continue where it stopped") from exc  # fmt: skip
    except Exception as exc:  # httpx's timeouts and connection errors, whose classes huggingface_hub does not wrap
        if type(exc).__module__.split(".")[0] not in ("httpx", "httpcore", "requests", "urllib3"):
            raise
        raise FetchError(f"{ref.shown}: the hub did not answer ({type(exc).__name__}: {_first(exc)}); check the "
                         "network or HF_ENDPOINT, then run the same ctrain fetch again to continue") from exc  # fmt: skip
    commit = Path(path).name
    record(home, ref, commit)
    return commit


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


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


def fetch_all(refs: list[HubRef], home: Path, emit: Callable[[str], None], *, progress: bool = True) -> list[str]:
    """Fetch each ref not yet in the cache at its revision (a branch is asked again: it may have moved);
    says what each became. Returns the commits."""
    commits = []
    for ref in refs:
        pinned = ref.revision is not None and cached_commit(home / "hub", ref) == ref.revision
        if pinned:
            emit(f"{ref.shown}: in {home} already (commit {ref.revision})")
            commits.append(ref.revision or "")
            continue
        commit = fetch(ref, home, progress=progress)
        emit(f"{ref.shown}: commit {commit} in {ref.folder(home / 'hub')}")
        commits.append(commit)
    return commits


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
