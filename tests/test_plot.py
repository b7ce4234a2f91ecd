"""evals/plot.py: reads metrics.jsonl files and writes a PNG; clear errors for missing or bad input."""
import json
import struct
import sys

import pytest

from evals import plot
from runtime.errors import UserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(folder, scale):
    """A run folder whose metrics.jsonl looks like train_gpt2.py's: val every 10 steps, train every 2."""
    folder.mkdir()
    lines = []
    for step in range(0, 41, 2):
        kind = "val_loss" if step % 10 == 0 else "train_loss"
        lines.append({"step": step, kind: 10.8 - scale * step ** 0.5, "train_time_ms": 150.0 * step,
                      "step_avg_ms": 150.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_two_runs_make_a_png(tmp_path, capsys):
    a, b = fake_run(tmp_path / "run_a", 0.7), fake_run(tmp_path / "run_b", 0.8)
    assert plot.read_metrics(a)["val_loss"][1] == (10, 1.5, pytest.approx(10.8 - 0.7 * 10 ** 0.5))
    out = tmp_path / "loss.png"
    assert plot.main([str(a), str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    # what was drawn: each run's validation line (the labelled one) against steps, and against seconds
    import matplotlib.pyplot as plt
    by_step, by_time = plt.gcf().axes
    for ax, x in ((by_step, [0, 10, 20, 30, 40]), (by_time, [0.0, 1.5, 3.0, 4.5, 6.0])):
        lines = {line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")}
        assert set(lines) == {"run_a", "run_b"}
        for name, scale in (("run_a", 0.7), ("run_b", 0.8)):
            assert list(lines[name].get_xdata()) == x
            assert list(lines[name].get_ydata()) == pytest.approx([10.8 - scale * s ** 0.5 for s in range(0, 41, 10)])
    plt.close("all")
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk follows the signature
    assert (width, height) == (1000, 400)  # figsize (10, 4) at 100 dpi
    assert 10_000 < len(data) < 150_000
    single = tmp_path / "single.png"
    plot.main([str(a), "--out", str(single), "--labels", "baseline"])
    assert single.read_bytes() != data  # the drawing depends on the runs


def test_out_names_the_file_written(tmp_path, capsys):
    """--out without a suffix gets matplotlib's .png, and the message names that file; its folder is made; a
    folder is refused before any drawing."""
    run = fake_run(tmp_path / "run", 0.7)
    assert plot.main([str(run), "--out", str(tmp_path / "plots" / "a")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'plots' / 'a.png'}\n"
    assert (tmp_path / "plots" / "a.png").read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(UserError, match=rf"--out {tmp_path / 'plots'} is a folder: give an image file, e.g. --out "
                                        rf"{tmp_path / 'plots' / 'loss.png'}"):
        plot.main([str(run), "--out", str(tmp_path / "plots")])


def test_missing_metrics_names_the_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty has no metrics.jsonl"):
        plot.main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")])


def test_bad_record_names_the_line(tmp_path):
    run = fake_run(tmp_path / "run", 0.7)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 42, "train_time_ms": 1.0}\n')
    with pytest.raises(UserError, match=r"metrics\.jsonl:22 is not a metrics record"):
        plot.read_metrics(run)


def test_labels_must_match_the_runs(tmp_path):
    run = fake_run(tmp_path / "run", 0.7)
    with pytest.raises(UserError, match="--labels has 2 names for 1 runs"):
        plot.main([str(run), "--labels", "a", "b"])


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    run = fake_run(tmp_path / "run", 0.7)
    with pytest.raises(UserError, match=r"pip install -e '\.\[plot\]'"):
        plot.main([str(run), "--out", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()
