"""`ctrain fetch` against a local server that speaks the hub's file API (tests/hubserver.py, through
HF_ENDPOINT), with the real huggingface_hub: models and data sets into the cache jobs mount, read back
offline by transformers and datasets as a job reads them; a download cut off and fetched again, a
wrong revision, a name the hub does not have, a gated model and its token, a server that stalls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.train import fetch as fetching
from tests.hubserver import HubRepo, HubServer

pytestmark = pytest.mark.integration

CONFIG = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "vocab_size": 16, "n_positions": 32}
MODEL = HubRepo("model", "org/tiny", {"config.json": json.dumps(CONFIG).encode(),
                                      "model.safetensors": os.urandom(300_000)})  # fmt: skip
DATA = HubRepo("dataset", "org/sums", {"data/train.jsonl": b"".join(
    json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a)}).encode() + b"\n" for a in range(50))})
GATED = HubRepo("model", "org/gated", {"config.json": json.dumps(CONFIG).encode()}, gated=True)
TOKEN = "hf_testtokenthatmustnotbewritten"
HUB_RECIPE = "model: {path: org/tiny}\ndata: {source: org/sums, format: hub}\ntask: sft\n"


def ctrain_fetch(project: Path, server: HubServer, home: Path, *args: str, token: str | None = None,
                 stall: int = 3) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`ctrain fetch ARGS` in its own process (huggingface_hub reads HF_ENDPOINT once, at import)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=server.url, HF_HOME=str(home), CTRAIN_FETCH_STALL=str(stall), HF_HUB_DISABLE_PROGRESS_BARS="1")
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "ctrain", "fetch", *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.fixture
def project(tmp_path: Path) -> Path:
    path = tmp_path / "proj"
    assert CliRunner().invoke(main, ["init", str(path)]).exit_code == 0
    return path


def test_a_model_and_a_data_set_reach_the_cache_and_load_offline_as_a_job_loads_them(project: Path,
                                                                                     tmp_path: Path) -> None:  # fmt: skip
    home = tmp_path / "hf"
    with HubServer([MODEL, DATA]) as server:
        out = ctrain_fetch(project, server, home, "org/tiny", "datasets/org/sums")
    assert out.returncode == 0, out.stderr
    assert f"org/tiny: commit {MODEL.sha} in {home / 'hub' / 'models--org--tiny'}" in out.stderr
    assert f"datasets/org/sums: commit {DATA.sha}" in out.stderr
    record = json.loads((home / fetching.RECORD).read_text())
    assert record["org/tiny"]["commit"] == MODEL.sha and record["datasets/org/sums"]["revision"] == "main"
    (project / "recipes" / "hub.yaml").write_text(HUB_RECIPE)
    offline = subprocess.run([sys.executable, "-c", (
        "import transformers; from ctrain.train.recipe import load_recipe; from ctrain.train.data import load_raw; "
        "print(transformers.AutoConfig.from_pretrained('org/tiny').n_embd); "
        "train, _ = load_raw(load_recipe('recipes/hub.yaml')); print(len(train), train[0]['completion'])")],
        cwd=project, env={**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                          "HF_ENDPOINT": "http://127.0.0.1:9"}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert offline.returncode == 0 and offline.stdout.split() == ["8", "50", "0"], offline.stderr[-3000:]
    absent = subprocess.run([sys.executable, "-m", "ctrain", "prepare", "recipes/hub.yaml", "data.source=org/other"],
                            cwd=project, env={**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"},
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert absent.returncode == 2 and "error: data.source org/other is not in the Hugging Face cache" in absent.stderr
    assert "ctrain fetch datasets/org/other" in absent.stderr, absent.stderr[-2000:]


def test_a_recipe_is_fetched_by_what_it_names_and_its_job_then_passes_the_cache_check(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (project / "recipes" / "hub.yaml").write_text(HUB_RECIPE)
    home = tmp_path / "hf"
    monkeypatch.chdir(project)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    before = CliRunner().invoke(main, ["submit", "--dry-run", "--runtime=apptainer", "recipes/hub.yaml"])
    assert "run ctrain fetch org/tiny datasets/org/sums first" in before.stderr, before.output
    with HubServer([MODEL, DATA]) as server:
        out = ctrain_fetch(project, server, home, "recipes/hub.yaml")
    assert out.returncode == 0, out.stderr
    after = CliRunner().invoke(main, ["submit", "--dry-run", "--runtime=apptainer", "recipes/hub.yaml"])
    assert "ctrain fetch" not in after.stderr and "Hugging Face cache" not in after.stderr, after.stderr


def test_a_download_cut_off_keeps_what_it_finished_and_the_next_fetch_gets_the_rest(project: Path,
                                                                                     tmp_path: Path) -> None:  # fmt: skip
    home = tmp_path / "hf"
    with HubServer([MODEL]) as server:
        server.die_after = 100_000  # config.json (under it) arrives; the weights never do
        # huggingface_hub retries a cut file for a few seconds, holding what it got in memory: the
        # stall limit here is above that, so that its own error is the outcome.
        cut = ctrain_fetch(project, server, home, "org/tiny", stall=30)
        assert cut.returncode == 1 and cut.stderr.count("\n") == 1, cut.stderr
        assert cut.stderr.startswith("error: org/tiny: the connection to the hub failed (") and "fetch again to continue" in cut.stderr
        assert not (home / fetching.RECORD).exists()
        server.die_after = None
        seen = len(server.requests)
        again = ctrain_fetch(project, server, home, "org/tiny")
        assert again.returncode == 0, again.stderr
        fetched = [path for method, path, _ in server.requests[seen:] if method == "GET" and "/resolve/" in path]
    assert fetched == [f"/org/tiny/resolve/{MODEL.sha}/model.safetensors"], fetched
    snapshot = home / "hub" / "models--org--tiny" / "snapshots" / MODEL.sha
    assert (snapshot / "model.safetensors").read_bytes() == MODEL.files["model.safetensors"]


@pytest.mark.parametrize(("name", "first_line"), [
    ("org/tiny@v9", "error: org/tiny@v9: the hub has no revision 'v9' of org/tiny (a branch, tag or commit): check it"),
    ("org/nothing", "error: org/nothing: no such model on the hub (or it is private and this machine has no token "
     "for it): check the name, or whether it is a data set (datasets/ORG/NAME)"),
    ("org/gated", "error: org/gated is gated: accept its terms on the hub, then give this machine your token"),
])  # fmt: skip
def test_a_name_the_hub_cannot_give_is_one_line_and_writes_nothing(project: Path, tmp_path: Path, name: str,
                                                                    first_line: str) -> None:  # fmt: skip
    home = tmp_path / "hf"
    with HubServer([MODEL, GATED], token=TOKEN) as server:
        out = ctrain_fetch(project, server, home, name)
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and out.stderr.startswith(first_line), out.stderr
    assert not (home / fetching.RECORD).exists()


def test_a_gated_model_comes_with_the_configured_token_which_no_file_ctrain_writes_holds(project: Path,
                                                                                         tmp_path: Path) -> None:  # fmt: skip
    home = tmp_path / "hf"
    with HubServer([GATED], token=TOKEN) as server:
        out = ctrain_fetch(project, server, home, "org/gated", token=TOKEN)
        sent = [headers.get("authorization") for _, path, headers in server.requests if "/resolve/" in path]
    assert out.returncode == 0, out.stderr
    assert sent and all(value == f"Bearer {TOKEN}" for value in sent)
    written = [p for p in [*home.rglob("*"), *project.rglob("*")] if p.is_file() and not p.is_symlink()]
    assert not [p for p in written if TOKEN.encode() in p.read_bytes()]
    assert TOKEN not in out.stdout + out.stderr


def test_a_server_that_stops_sending_is_given_up_with_one_line(project: Path, tmp_path: Path) -> None:
    """No byte for CTRAIN_FETCH_STALL seconds (3 here) ends the download, where huggingface_hub alone
    would retry a stalled file for minutes (and wait on a stalled info request without end)."""
    home = tmp_path / "hf"
    with HubServer([MODEL]) as server:
        server.stall_after = 50_000
        started = time.monotonic()
        out = ctrain_fetch(project, server, home, "org/tiny")
        took = time.monotonic() - started
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: org/tiny: the hub stopped answering (no byte in 3 s; {server.url})")
    assert took < 30, took
