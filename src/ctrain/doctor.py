"""``ctrain doctor``: what this machine has for each ctrain workflow, and what is missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from ctrain import proc
from ctrain.errors import ConfigError, CtrainError
from ctrain.ui import table


@dataclass(frozen=True)
class Check:
    """One thing doctor looks for."""

    name: str
    ok: bool
    detail: str


def _version_line(text: str) -> str:
    """A tool's version as one line: its first line, or ``version`` of a JSON answer (``pcluster version``)."""
    if text.startswith("{"):
        try:
            version = json.loads(text[:4096]).get("version")
        except (ValueError, AttributeError):
            version = None
        return f"version {version}" if isinstance(version, str) else ""
    return text.splitlines()[0].strip() if text else ""


def _tool(tool: str, version_args: tuple[str, ...] = ("--version",)) -> Callable[[], Check]:
    def check() -> Check:
        path = proc.which(tool)
        if not path:
            return Check(tool, False, proc.TOOLS[tool].hint if tool in proc.TOOLS else "not on PATH")
        detail = path
        if version_args:
            try:
                out = proc.run([path, *version_args], check=False, timeout=20)
                text = (out.stdout or out.stderr).strip()
                first = _version_line(text)
                if first and out.returncode == 0:
                    detail = f"{first} ({path})"
            except CtrainError:
                pass
        return Check(tool, True, detail)

    return check


def _ask(name: str, argv: list[str]) -> Check | subprocess.CompletedProcess[str]:
    """``argv``'s completed process, or the failed Check ``name`` when it is missing or cannot run."""
    if not proc.which(argv[0]):
        return Check(name, False, f"{argv[0]} not found")
    try:
        return proc.run(argv, check=False, timeout=20)
    except CtrainError as exc:
        return Check(name, False, str(exc).splitlines()[0])


def _controller() -> Check:
    out = _ask("slurm controller", ["scontrol", "ping"])
    if isinstance(out, Check):
        return out
    text = (out.stdout + out.stderr).strip()
    up = out.returncode == 0 and " is UP" in text
    return Check("slurm controller", up, text.splitlines()[0] if text else f"scontrol ping exited {out.returncode}")


def _pyxis() -> Check:
    """pyxis as srun loads it (plugstack.conf): its options appear in ``srun --help`` only then."""
    out = _ask("pyxis", ["srun", "--help"])
    if isinstance(out, Check):
        return out
    if "--container-image" not in out.stdout:
        return Check("pyxis", False, "srun does not load pyxis (no --container-image in srun --help; see plugstack.conf)")
    return Check("pyxis", True, "loaded by srun (--container-image)")


def _gpus() -> Check:
    if not proc.which("nvidia-smi"):
        return Check("gpus", False, "nvidia-smi not found (no NVIDIA driver)")
    try:
        out = proc.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False, timeout=30)
    except CtrainError as exc:
        return Check("gpus", False, str(exc).splitlines()[0])
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not names:
        return Check("gpus", False, (out.stderr or out.stdout).strip() or "no GPU visible")
    return Check("gpus", True, f"{len(names)} x {names[0]}")


def _python(module: str, dist: str | None = None) -> Callable[[], Check]:
    def check() -> Check:
        if importlib.util.find_spec(module) is None:
            from ctrain.train.stack import install_line

            return Check(module, False, install_line())
        try:
            return Check(module, True, importlib.metadata.version(dist or module))
        except importlib.metadata.PackageNotFoundError:
            return Check(module, True, "installed")

    return check


CHECKS: dict[str, Callable[[], Check]] = {
    "apptainer": _tool("apptainer"),
    "docker": _tool("docker"),
    "podman": _tool("podman"),
    "buildah": _tool("buildah"),
    "skopeo": _tool("skopeo"),
    "umoci": _tool("umoci"),
    "mksquashfs": _tool("mksquashfs", ("-version",)),
    "enroot": _tool("enroot", ("version",)),
    "pyxis": _pyxis,
    "rsync": _tool("rsync"),
    "ssh": _tool("ssh", ("-V",)),
    "sbatch": _tool("sbatch"),
    "srun": _tool("srun"),
    "slurm controller": _controller,
    "nvidia-smi": _tool("nvidia-smi", ()),
    "gpus": _gpus,
    "torch": _python("torch"),
    "transformers": _python("transformers"),
    "trl": _python("trl"),
    "datasets": _python("datasets"),
    "accelerate": _python("accelerate"),
    "deepspeed": _python("deepspeed"),
    "pcluster": _tool("pcluster", ("version",)),
}

# Each workflow needs every group; a group is satisfied by any one of its options, and an option
# "a+b" needs all of its checks (ctrain writes the squashfs itself when enroot is missing).
WORKFLOWS: dict[str, tuple[tuple[str, ...], ...]] = {
    "build": (("docker", "podman", "buildah", "apptainer"),),
    "sif": (("apptainer",),),
    "sqsh": (("enroot", "mksquashfs+skopeo+umoci"),),
    "push": (("skopeo", "podman", "docker", "apptainer", "rsync"),),
    "slurm": (("sbatch",), ("srun",), ("slurm controller",)),
    "apptainer-jobs": (("sbatch",), ("srun",), ("slurm controller",), ("apptainer",)),
    "pyxis-jobs": (("sbatch",), ("srun",), ("slurm controller",), ("pyxis",)),
    "gpu": (("nvidia-smi",), ("gpus",)),
    "train": (("torch",), ("transformers",), ("trl",), ("datasets",), ("accelerate",)),
    "cluster": (("pcluster",),),
}


def run_checks(names: list[str] | None = None) -> dict[str, Check]:
    """Run the named checks (all by default)."""
    return {name: CHECKS[name]() for name in (names or list(CHECKS))}


def workflow_status(results: dict[str, Check], workflow: str) -> list[str]:
    """Groups of ``workflow`` that nothing satisfies, as 'a or b' strings (empty: ready)."""

    def ok(option: str) -> bool:
        return all(results[c].ok for c in option.split("+"))

    return [" or ".join(group) for group in WORKFLOWS[workflow] if not any(ok(o) for o in group)]


def report(workflows: list[str]) -> tuple[str, bool]:
    """The doctor's text and whether every chosen workflow is ready."""
    for w in workflows:
        if w not in WORKFLOWS:
            raise ConfigError(f"unknown workflow '{w}'; valid: {', '.join(WORKFLOWS)}")
    results = run_checks()
    checks = table(
        ["check", "status", "detail"], [[c.name, "ok" if c.ok else "missing", c.detail] for c in results.values()]
    )
    rows, ready = [], True
    for w in WORKFLOWS:
        lacking = workflow_status(results, w)
        chosen = w in workflows
        if chosen and lacking:
            ready = False
        mark = "ready" if not lacking else "MISSING" if chosen else "not ready"
        rows.append([w + (" *" if chosen else ""), mark, "needs " + "; ".join(lacking) if lacking else ""])
    flows = table(["workflow", "status", "what is missing"], rows)
    return f"{checks}\n\n{flows}\n", ready
