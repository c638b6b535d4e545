"""Notebooks for tests/test_browser_views.py, written with nbformat into a test's tmp folder.

- ``rank_views_notebook``: 4 CPU ranks run a traced 1F1B step (PP=4, synthetic costs), a ZeRO-3
  experiment, the collectives and a memory measurement; every view is drawn from what they return.
- ``rankless_notebook``: no ranks, one browser session for every view drawn from saved records (a
  JupyterLab session costs more than the views): one PipelineTimeline of 8 ranks x 32 micro-batches
  x F/I/W shown three times (three renders) with its state size printed; the same step five times
  in one ScheduleGallery, shown three times; then the cells ``extra_cells`` adds (the expert and
  context views).
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

PP, MICROBATCHES, T_FORWARD = 4, 8, 0.02  # F = t, B = 2t: about 0.7 s per traced step
RANKS_DONE = "rank views are ready"
PERF_DONE = "perf views are ready"
PERF_MARK = "widget state bytes:"  # the line the test parses: json {"state_bytes", "data_bytes"}
PERF_RENDERS = 3

RANK_CELLS = [
    ("import warnings\nimport lab\nfrom kernels.engine.collectives import run_collectives\n"
     "from lab.measure.memory_and_comm import measure_layout\n"
     "from widgets import CollectiveView, MemoryView, ShardingView\n"
     "warnings.simplefilter('ignore', lab.OversubscribedWarning)  # 4 ranks on a 2-core machine\n"
     "cluster = lab.start(n=4, backend='gloo', timeout=120)"),
    (f"PP, M = {PP}, {MICROBATCHES}\n"
     "traced = lab.Experiment(cluster, lab.GPT(layers=PP, d_model=16, heads=2, vocab=32, seq_len=8),\n"
     "                        lab.Parallel(pp=PP, schedule='1f1b', microbatches=M), global_batch=M, steps=2,\n"
     f"                        trace=True, synthetic_forward_s={T_FORWARD}).run()\n"
     "timeline = traced.timeline()\ntimeline"),
    ("exp = lab.Experiment(cluster, lab.GPT(layers=2, d_model=16, heads=2, vocab=32, seq_len=8),\n"
     "                     lab.Parallel(dp=4, zero=3), global_batch=8, steps=1)\n"
     "result = exp.run()\nShardingView(result.layout)"),
    "cluster.view()",
    "CollectiveView(cluster.run(run_collectives))",
    "MemoryView([r.to_dict() for r in measure_layout(cluster, exp.config())['memory']])",
    f"cluster.stop()\nprint({RANKS_DONE!r})",
]

PERF_CELLS = [
    ("import json\nfrom widgets import PipelineTimeline\nsaved = json.load(open('perf.json'))\n"
     "timeline = PipelineTimeline(saved['events'], saved['bubble'], saved['planned'])\n"
     "state = timeline.get_state()  # what the comm's open message carries, ESM and CSS included\n"
     "data = {k: state[k] for k in ('ranks', 'events', 'planned', 'plan_match', 'mean_ms', 'span_ms', 'bubble')}\n"
     f"print({PERF_MARK!r}, json.dumps({{'state_bytes': len(json.dumps(state)), "
     "'data_bytes': len(json.dumps(data))}))"),
    *["timeline"] * PERF_RENDERS,  # each display is a new view: one more render of the same state
    f"print({PERF_DONE!r})",
]

GALLERY_DONE = "gallery views are ready"
GALLERY_CELLS = [
    ("import json\nfrom widgets import ScheduleGallery\nsaved = json.load(open('perf.json'))\n"
     "gallery = ScheduleGallery({f'run {i}': (saved['events'], saved['bubble']) for i in range(5)})\n"
     "state = gallery.get_state()  # what the comm's open message carries, ESM and CSS included\n"
     "data = {k: state[k] for k in ('panels', 'span_ms')}\n"
     f"print({PERF_MARK!r}, json.dumps({{'state_bytes': len(json.dumps(state)), "
     "'data_bytes': len(json.dumps(data))}))"),
    *["gallery"] * PERF_RENDERS,
    f"print({GALLERY_DONE!r})",
]
RANKLESS_DONE = "rank-less views are ready"


def _write(cells: list[str], path: Path) -> Path:
    nb = new_notebook(cells=[new_code_cell(src) for src in cells], metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def rank_views_notebook(tmp_path: Path) -> Path:
    return _write(RANK_CELLS, tmp_path / "src" / "rank_views.ipynb")


def rankless_notebook(tmp_path: Path, saved: dict, extra_cells: list[str]) -> Path:
    """``saved``: {events, bubble, planned} of one 8 x 32 x F/I/W step, written beside the notebook's copy
    (the kernel's cwd); the timeline cells, the gallery cells, ``extra_cells``, then ``RANKLESS_DONE``."""
    (tmp_path / "perf.json").write_text(json.dumps(saved))
    cells = [*PERF_CELLS, *GALLERY_CELLS, *extra_cells, f"print({RANKLESS_DONE!r})"]
    return _write(cells, tmp_path / "src" / "rankless_views.ipynb")
