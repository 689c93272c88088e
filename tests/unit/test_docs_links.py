"""The README and docs/ hold together: every relative link names a file that exists, every #anchor a
heading of the page it points to (as GitHub makes anchors from headings), and the README's quickstart
block is the two commands CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+(?:\([^()\s]*\))?)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (links as their text, no code marks), lower
    case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[`*]", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(page.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The targets of a page's links, outside code blocks and code spans."""
    targets = []
    for line in _prose(page.read_text()):
        targets += _LINK.findall(_CODE_SPAN.sub("", line))
    return targets


def test_the_slug_is_githubs() -> None:
    assert slug("Full fine-tuning of the Llama-3.1-8B shape, FSDP2 (4 H200)") == (
        "full-fine-tuning-of-the-llama-31-8b-shape-fsdp2-4-h200"
    )
    assert slug("Slurm's TERM and the Bus error") == "slurms-term-and-the-bus-error"
    assert slug("`ctrain train` on GPUs") == "ctrain-train-on-gpus"
    assert slug("[One run](x.md) across job ids") == "one-run-across-job-ids"


def test_the_pages_are_found() -> None:
    assert REPO / "README.md" in PAGES and REPO / "docs" / "benchmarks.md" in PAGES
    assert any(p.parent.name == "log" for p in PAGES), "docs/log/ holds the measurement logs"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: and the like
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_readmes_quickstart_is_the_two_commands_ci_runs() -> None:
    """The fenced block that starts the demo holds exactly two commands; the second is the test
    command that .ci/run runs."""
    blocks, block, fenced = [], [], False
    for line in (REPO / "README.md").read_text().splitlines():
        if _FENCE.match(line.lstrip()):
            if fenced:
                blocks.append(block)
            block, fenced = [], not fenced
        elif fenced:
            block.append(line)
    quickstart = [b for b in blocks if any("scripts/quickstart.sh" in line for line in b)]
    assert len(quickstart) == 1, "one README block runs scripts/quickstart.sh"
    commands = [line.strip() for line in quickstart[0] if line.strip() and not line.strip().startswith("#")]
    assert commands == ["./scripts/quickstart.sh", "./scripts/test.sh"], commands
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"(^|\s)scripts/test\.sh(\s|$)", ci), ".ci/run runs scripts/test.sh"
