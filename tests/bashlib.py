"""The real sbatch library, run by bash on a made-up 2-node allocation with Slurm's commands faked.

What tests/unit/test_sbatch.py's ``fake_slurm`` fixture and ``library`` helper do, shared: a bin/
directory of stand-ins for scontrol (``show hostnames|hostlist`` from the real one, reading a
minimal slurm.conf: it needs no controller), sinfo, scancel and srun, which write what the library
asks of Slurm to calls.log and take their answers from files. The library is always sourced as a
job sources it, ``sbatch/lib/ctrain.sh``, which sources its parts from beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIB_DIR = REPO / "sbatch" / "lib"
LIB = LIB_DIR / "ctrain.sh"
JOB = "4242"  # the made-up job's id
NODES = ("gpu001", "gpu002")  # its nodes, in a partition gpu[001-004]


def library_text() -> str:
    """Every file of the library (``sbatch/lib/**/*.sh``, the programs the nodes run included), one after another."""
    return "\n".join(path.read_text() for path in sorted(LIB_DIR.rglob("*.sh")))


def slurm_conf(directory: Path) -> Path:
    """Just enough slurm.conf for `scontrol show hostnames` to expand node lists offline."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "slurm.conf"
    path.write_text("ClusterName=unit\nSlurmctldHost=localhost\nNodeName=gpu[001-016]\nPartitionName=p Nodes=ALL\n")
    return path


def fake_slurm(directory: Path) -> Path:
    """DIRECTORY with bin/ holding the stand-ins for Slurm's commands; returns DIRECTORY (the project)."""
    real = shutil.which("scontrol")
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "scontrol": f"""echo "scontrol $*" >>"$FAKE/calls.log"
case "$1 $2" in
    "show hostnames" | "show hostlist") exec {real} "$@" ;;
    "show job") [ ! -e "$FAKE/no-controller" ] || exit 1
        echo "JobId={JOB} JobState=$(cat "$FAKE/jobstate" 2>/dev/null || echo RUNNING) Restarts=0" \
        "ExcNodeList=$(cat "$FAKE/excluded" 2>/dev/null || echo '(null)')" ;;
    "show config") echo "SlurmdPort              = $(cat "$FAKE/port")" ;;
    "show node") echo "NodeName=$4 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$4" ;;
    "write batch_script") echo "#!/bin/bash (job $3's script)" >"$4" ;;
esac""",
        # sbatch: its arguments to calls.log (and one a line to sbatch-args), the CTRAIN_RUN*, CTRAIN_CONT*
        # and SLURM_* it was given to sbatch-env; answers $FAKE/sbatch-id, or refuses as a QOS limit does
        # where that is missing; TERMs the process in $FAKE/term-pid first, as a scancel meanwhile does.
        "sbatch": 'echo "sbatch $*" >>"$FAKE/calls.log"; printf "%s\\n" "$@" >"$FAKE/sbatch-args"; '
                  '[ ! -e "$FAKE/term-pid" ] || kill -TERM "$(cat "$FAKE/term-pid")"; env | grep -E "^(CTRAIN_RUN|CTRAIN_CONT|SLURM_)" | sort '
                  '>"$FAKE/sbatch-env"; [ -e "$FAKE/sbatch-id" ] || { echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" '
                  '>&2; exit 1; }; cat "$FAKE/sbatch-id"',
        "sinfo": 'echo "sinfo $*" >>"$FAKE/calls.log"; cat "$FAKE/sinfo"',
        "scancel": 'echo "scancel $*" >>"$FAKE/calls.log"',
        # A probe of a node named in $FAKE/dead hangs, as srun does for a node whose slurmd is gone;
        # one named in $FAKE/refused fails at once; any other answers.
        "srun": 'echo "srun $*" >>"$FAKE/calls.log"; for a; do case $a in --nodelist=*) '
                '! grep -qx "${a#*=}" "$FAKE/refused" 2>/dev/null || exit 1; '
                '! grep -qx "${a#*=}" "$FAKE/dead" 2>/dev/null || exec sleep 60 ;; esac; done',
    }  # fmt: skip
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return directory


RUN_DIR = "pids"  # the run's directory in the fake project, as CTRAIN_RUN_DIR and CTRAIN_PIDS name it
TIMELINE = f".ctrain/{JOB}.timeline"


def library(fake: Path, commands: str, conf: Path, **env: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``commands`` in bash with the library sourced, in the fake project FAKE (the working
    directory), for a 2-node job on gpu[001-002]; ENV adds variables, or with None removes one."""
    base: dict[str, str | None] = {
        "PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "FAKE": str(fake), "SLURM_CONF": str(conf),
        "SLURM_JOB_ID": JOB, "SLURM_JOB_NODELIST": "gpu[001-002]", "SLURM_JOB_PARTITION": "p",
        "CTRAIN_NNODES": "2", "CTRAIN_MAX_REQUEUES": "10", "CTRAIN_REQUEUE_EXIT": "75",
        "CTRAIN_PROJECT_DIR": str(fake), "CTRAIN_RUN_DIR": RUN_DIR, "CTRAIN_PIDS": RUN_DIR,
        "CTRAIN_TIMELINE": TIMELINE, "CTRAIN_STEP_GRACE": "1", "CTRAIN_BATCH_HOST": NODES[0], "CTRAIN_RUN": JOB,
        "CTRAIN_CONTINUE": "1",
    }  # fmt: skip
    base.update(env)
    return subprocess.run(["bash", "-c", f'source "$0"; {commands}', str(LIB)], cwd=fake, capture_output=True,
                          env={k: v for k, v in base.items() if v is not None}, text=True, timeout=60, check=False)  # fmt: skip


def calls(fake: Path, command: str) -> list[str]:
    """What the library asked of Slurm's COMMAND (``scontrol requeue``, ``srun``, ...), in order."""
    log = fake / "calls.log"
    return [line for line in log.read_text().splitlines() if line.startswith(command)] if log.exists() else []
