"""Credential masking: one function for everything ctrain prints or raises (command errors, streamed
tool output, log lines, the CLI's error line)."""

from __future__ import annotations

import shlex
import sys

import pytest
from click.testing import CliRunner

from ctrain import proc, ui
from ctrain.errors import CommandError, CtrainError
from ctrain.redact import redact, redact_command


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("https://user:S3CRET@pypi.example.org/simple", "https://***:***@pypi.example.org/simple"),
        ("http://user:S3CRET@127.0.0.1:9/simple", "http://***:***@127.0.0.1:9/simple"),
        ("https://user:p%40ss@host/simple/", "https://***:***@host/simple/"),
        ("https://:S3CRET@host/x", "https://***:***@host/x"),
        ("https://user:S3@CRET@host/simple", "https://***:***@host/simple"),
        ("oras://bob:S3CRET@registry:5000/x:1", "oras://***:***@registry:5000/x:1"),
        ("--extra-index-url=https://u:S3CRET@h/simple", "--extra-index-url=https://***:***@h/simple"),
        ("https://S3CRET@github.com/me/repo.git", "https://***@github.com/me/repo.git"),
        ("git+https://S3CRET@github.com/me/repo", "git+https://***@github.com/me/repo"),
        ("Looking in indexes: https://user:****@host/simple", "Looking in indexes: https://***:***@host/simple"),
        ("skopeo copy --dest-creds alice:S3CRET x", "skopeo copy --dest-creds *** x"),
        ("--src-creds=alice:S3CRET", "--src-creds=***"),
        ("--password S3CRET --password-stdin", "--password *** --password-stdin"),
        ("curl -H 'Authorization: Bearer S3CRET' x", "curl -H 'Authorization: Bearer ***' x"),
        ("authorization: Basic S3CRET", "authorization: Basic ***"),
        ("https://h/x?token=S3CRET&page=2", "https://h/x?token=***&page=2"),
        ("password=S3CRET", "password=***"),
        ('{"access_token": "S3CRET"}', '{"access_token": "***"}'),
        ("client_secret: S3CRET", "client_secret: ***"),
        ("HF_TOKEN=S3CRET AWS_SECRET_ACCESS_KEY=S3CRET", "HF_TOKEN=*** AWS_SECRET_ACCESS_KEY=***"),
        # nothing secret: left as it is
        ("ssh://alice@login.hpc:2222/scratch/", "ssh://alice@login.hpc:2222/scratch/"),
        ("alice@login.hpc:/scratch/images/", "alice@login.hpc:/scratch/images/"),
        ("docker://127.0.0.1:5000/ci/ctrain@sha256:" + "a" * 64,) * 2,
        ("http://127.0.0.1:9/simple", "http://127.0.0.1:9/simple"),
        ("--secret id=ctrain-netrc,src=/tmp/ctrain-secrets-x/ctrain-netrc",) * 2,
        ("RUN --mount=type=secret,id=ctrain-netrc sh", "RUN --mount=type=secret,id=ctrain-netrc sh"),
        ("pad_token: <pad>, eos_token=</s>, 1,234 tokens/s", "pad_token: <pad>, eos_token=</s>, 1,234 tokens/s"),
        ("cannot open /etc/passwd: permission denied", "cannot open /etc/passwd: permission denied"),
    ],
)
def test_redact(text: str, masked: str) -> None:
    assert redact(text) == masked
    assert redact(masked) == masked  # masking twice changes nothing


def test_redact_command_masks_each_argument_and_option_values() -> None:
    argv = ["skopeo", "copy", "--dest-creds", "alice:S3CRET", "--creds=bob:S3CRET", "--password", "S3CRET",
            "--build-arg", "TORCH_INDEX_URL=https://u:S3CRET@h/simple", "docker://h/x:1"]
    masked = redact_command(argv)
    assert masked == ["skopeo", "copy", "--dest-creds", "***", "--creds=***", "--password", "***",
                      "--build-arg", "TORCH_INDEX_URL=https://***:***@h/simple", "docker://h/x:1"]
    assert "S3CRET" not in shlex.join(masked)


def test_command_error_masks_command_stderr_and_stdout() -> None:
    err = CommandError(["pip", "download", "--extra-index-url", "https://u:S3CRET@h/simple"], 1,
                       "401 for https://u:S3CRET@h/simple/x/", "token=S3CRET")
    assert "S3CRET" not in str(err) + " ".join(err.cmd) + err.stderr + err.stdout
    assert "https://***:***@h/simple" in str(err)


def test_failing_command_printed_without_credentials() -> None:
    """Both ways of running programs: the error carries the masked command and output."""
    url = "https://user:S3CRET@host/simple"
    code = "import sys; print(sys.argv[1]); sys.exit(3)"
    for run in (lambda: proc.run([sys.executable, "-c", code, url]),
                lambda: proc.stream([sys.executable, "-c", code, url], on_line=lambda line: None)):
        with pytest.raises(CommandError) as info:
            run()
        assert "S3CRET" not in str(info.value) and "https://***:***@host/simple" in str(info.value)


def test_timeout_error_masked_and_not_chained() -> None:
    with pytest.raises(CommandError) as info:
        proc.run([sys.executable, "-c", "import time; time.sleep(5)", "password=S3CRET"], timeout=0.3)
    assert "S3CRET" not in str(info.value) and info.value.__cause__ is None


def test_streamed_lines_and_log_lines_are_masked(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[str] = []
    proc.stream([sys.executable, "-c", "print('GET https://u:S3CRET@h/simple')"], on_line=seen.append)
    assert seen == ["GET https://***:***@h/simple"]
    proc.stream([sys.executable, "-c", "print('Authorization: Bearer S3CRET')"], prefix="x: ")
    ui.info("build: index https://u:S3CRET@h/simple")
    err = capsys.readouterr().err
    assert "S3CRET" not in err and "x: Authorization: Bearer ***" in err and "https://***:***@h/simple" in err


def test_cli_error_line_is_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: any CtrainError message, whoever raised it."""
    from ctrain import cli

    def boom(*args: object, **kwargs: object) -> None:
        raise CtrainError("could not reach https://user:S3CRET@host/simple")

    monkeypatch.setattr("ctrain.doctor.report", boom)
    result = CliRunner().invoke(cli.main, ["doctor"])
    assert result.exit_code == 1
    assert "S3CRET" not in result.output and "https://***:***@host/simple" in result.output
