"""Results you can look at (ctrain.jobs.plots): the picture's content read back, not only that a file
exists: the points of every curve from the HTML page's SVG, each run's colour among the PNG's pixels,
and the timeline's segments with their lengths."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import protocol
from ctrain.cli import main
from ctrain.jobs import history, plots

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 4-task sweep as its tasks left it: task K logged 10 + K steps of training loss, and two evals."""
    (tmp_path / "ctrain.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    tasks = []
    for index in range(4):
        output = tmp_path / "outputs" / f"t{index}"
        output.mkdir(parents=True)
        lines = [{"step": 3, "loss": 9.0}]  # a run that was lost after step 3: its resume logs it again, and wins
        lines += [{"step": s, "loss": 2.0 / (s + index)} for s in range(1, 11 + index)]
        lines += [{"step": s, "eval_loss": 2.5 / (s + index)} for s in (5, 10)]
        (output / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        tasks.append({"task": index, "name": output.name, "values": {"lr": str(index)}, "output": str(output)})
    history.record(tmp_path, "70", "sweep", ["recipes/demo.yaml"], sweep=tasks)
    return tmp_path


def _points(d: str) -> list[tuple[float, float]]:
    numbers = [float(n) for n in re.findall(r"-?[0-9.]+(?:e-?\d+)?", d)]
    return list(zip(numbers[::2], numbers[1::2]))


def test_the_html_page_holds_every_tasks_train_and_eval_curve_point_for_point(sweep: Path) -> None:
    out = CliRunner().invoke(main, ["results", "70", "--plot", "losses.html"])
    assert out.exit_code == 0, out.output
    assert "plot: 8 curve(s) of 4 run(s) in losses.html" in out.output
    page = (sweep / "losses.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page  # self-contained, nothing to run
    svg = ET.fromstring(page[page.index("<svg"):page.index("</svg>") + 6])
    groups = {g.get("id"): g for g in svg.iter(f"{SVG}g") if g.get("id")}
    for index in range(4):
        train = _points(groups[f"train-70_{index}"].find(f"{SVG}path").get("d"))
        assert len(train) == 10 + index
        ys = [y for _, y in train]  # SVG's y grows downwards: a falling loss is a rising y
        assert ys == sorted(ys), f"task {index}'s loss falls at every step, the step-3 repeat replaced"
        assert len(_points(groups[f"eval-70_{index}"].find(f"{SVG}path").get("d"))) == 2
    assert "70_3 lr=3 (train)" in page and "<td>70_3</td>" in page


def test_the_png_has_each_tasks_colour_and_no_other_runs(sweep: Path) -> None:
    import matplotlib.image

    out = CliRunner().invoke(main, ["results", "70_0", "70_2", "--plot", "two.png"])
    assert out.exit_code == 0, out.output
    pixels = matplotlib.image.imread(sweep / "two.png")[..., :3]

    def count(colour: str) -> int:
        rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return int((abs(pixels - rgb).max(axis=-1) < 0.02).sum())

    assert count(plots.COLOURS[0]) > 200 and count(plots.COLOURS[1]) > 200  # the two runs' curves
    assert count(plots.COLOURS[2]) == 0 and count(plots.COLOURS[3]) == 0  # nothing else drawn


def test_the_report_draws_each_runs_segments_at_their_lengths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run preempted once and resumed: two bars, each segment as long as the account says."""
    (tmp_path / "ctrain.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / protocol.STATE_DIR).mkdir()
    (tmp_path / protocol.STATE_DIR / protocol.timeline_file("9")).write_text(
        "100.0 0 start 90.0 2 0\n101.0 0 launched\n160.0 0 exited 75\n160.5 0 decided requeued TERM\n"
        "170.0 1 start 165.0 2 0\n171.0 1 launched\n230.0 1 exited 0\n230.5 1 decided finished none\n")
    out = CliRunner().invoke(main, ["report", "9", "--plot", "time.svg"])
    assert out.exit_code == 0, out.output
    account = json.loads(CliRunner().invoke(main, ["report", "9", "--json"]).output)
    svg = ET.parse(tmp_path / "time.svg").getroot()
    widths = {}
    for g in svg.iter(f"{SVG}g"):
        if (gid := g.get("id") or "").startswith("run-"):
            xs = [x for x, _ in _points(g.find(f"{SVG}path").get("d"))]
            widths[gid] = max(xs) - min(xs)
    expected = {f"run-{r['restart']}-{k}": v for r in account["runs"] for k, v in r["seconds"].items() if v > 0}
    assert set(widths) == set(expected), (widths, expected)
    scale = widths["run-0-queue"] / expected["run-0-queue"]
    for gid, seconds in expected.items():
        assert widths[gid] == pytest.approx(seconds * scale, rel=0.02, abs=0.5), gid
    labels = "".join(svg.itertext())
    assert "run 0: requeued (Slurm" in labels and "run 1: finished" in labels, labels


@pytest.mark.parametrize("name", ["losses.pdf", "losses"])
def test_a_plot_file_of_another_kind_is_refused_before_anything_is_read(sweep: Path, name: str) -> None:
    out = CliRunner().invoke(main, ["results", "70", "--plot", name])
    assert out.exit_code == 2 and out.output.startswith(f"error: --plot {name}: name a .png, .svg or .html file")
