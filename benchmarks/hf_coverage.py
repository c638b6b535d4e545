"""Every causal-LM type in the installed transformers, tiny, under DP2, TP2 and PP2 on one warm pool.

For each type: its default config, shrunk through the config's own attributes (width, depth, heads,
vocabulary, experts: ``lab.run.shrunk_config``), read by the lab (``lab.run.own_models``) and run once forward and backward in
one process (a type whose tiny config does not build or run there is listed as ``no tiny model``,
with its error); then each layout on 2 CPU ranks for 2 steps, beside the one-process reference.
Each case ends as one of:

- ``match``: every step's loss equals one process (rtol 1e-4);
- ``refused [rule]``: refused before launch by a named rule;
- ``mismatch``: it ran and differs (the relative difference);
- ``crash``: it ran and raised (the first line of the error);
- ``hang``: no result within the timeout.

The goal is no crash, hang or mismatch. The table goes to ``docs/models.md`` (``--write``).

Run: ``python benchmarks/hf_coverage.py [--only llama,gpt2] [--write]``
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import lab
from kernels.contract.config_rules import ConfigError
from lab.run.own_models import own_config
from lab.run.shrunk_config import tiny_config

LAYOUTS = {"DP2": dict(dp=2), "TP2": dict(tp=2), "PP2": dict(pp=2, microbatches=2)}
SEQ_LEN, GLOBAL_BATCH, STEPS, TIMEOUT_S = 16, 4, 2, 180
MAX_PARAMS, CHUNK = 20_000_000, 20  # a process per CHUNK types: every modeling module imported stays in memory


def runs_in_one_process(config) -> None:
    """Raise what the tiny model raises in one process, before any layout is tried on it (and refuse one that
    the shrinking left large: a size the SHRINK table does not know, such as a hashed byte vocabulary)."""
    from kernels.model.own_model import build_own, meta_own
    spec = own_config(lab.Model(config, seq_len=SEQ_LEN)).spec
    count = sum(p.numel() for p in meta_own(spec).parameters())
    if count > MAX_PARAMS:
        raise ValueError(f"{count:,} parameters after shrinking (more than {MAX_PARAMS:,})")
    build_own(spec, seed=0)(torch.zeros(2, SEQ_LEN, dtype=torch.long)).sum().backward()


def one_case(cluster: lab.Cluster, config, layout: dict) -> str:
    try:
        exp = lab.Experiment(cluster, lab.Model(config, seq_len=SEQ_LEN), lab.Parallel(**layout),
                             global_batch=GLOBAL_BATCH, steps=STEPS, lr=3e-3)
    except lab.ParallelConfigError as error:
        return "refused " + " ".join(f"[{rule}]" for rule, _ in error.problems[:2])
    try:
        result = exp.run(progress=False, timeout=TIMEOUT_S)
        reference = exp.reference()
    except lab.RankTimeoutError:
        return "hang"
    except Exception as error:  # the case's outcome, recorded: the benchmark goes on to the next
        return f"crash: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result.losses, reference.losses))
    return "match" if worst <= 1e-4 else f"mismatch (rel {worst:.1e})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--write", action="store_true", help="write the table to docs/models.md")
    parser.add_argument("--rows-to", help=argparse.SUPPRESS)  # a chunk's process: its rows as JSON, here
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    types = [t.strip() for t in args.only.split(",") if t.strip()] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    began = time.perf_counter()
    if args.rows_to:
        Path(args.rows_to).write_text(json.dumps(coverage_rows(types)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for start in range(0, len(types), CHUNK):
            out = Path(scratch) / f"rows{start}.json"
            subprocess.run([sys.executable, __file__, "--only", ",".join(types[start:start + CHUNK]),
                            "--rows-to", str(out)], check=True)
            rows += [tuple(row) for row in json.loads(out.read_text())]
    counts = {name: collections.Counter(_kind(o[name]) for _, o, _ in rows) for name in LAYOUTS}
    summary = "\n".join(f"- {name}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(c.items())) for name, c in counts.items())
    print(summary, f"\n{len(rows)} types in {time.perf_counter() - began:.0f} s", flush=True)
    if args.write:
        write_table(rows, summary)


def _kind(outcome: str) -> str:
    return "no tiny model" if outcome.startswith("no tiny") else outcome.split(" ")[0].rstrip(":")


def coverage_rows(types: list[str]) -> list[tuple[str, dict[str, str], str]]:
    """Each type's row: its outcome per layout, and why it has no tiny model where it has none."""
    rows = []
    with lab.start(n=2, backend="gloo", threads_per_rank=1, activate=False) as cluster:
        for model_type in types:
            try:
                config = tiny_config(model_type)
                runs_in_one_process(config)
            except (ConfigError, Exception) as error:  # noqa: BLE001 - a type that does not build is a row too
                first = (error.problems[0][1] if isinstance(error, ConfigError) else str(error)).splitlines()[0]
                rows.append((model_type, {name: "no tiny model" for name in LAYOUTS}, first[:120]))
                print(f"{model_type:28} no tiny model runs in one process: {first[:100]}", flush=True)
                continue
            outcomes = {name: one_case(cluster, config, layout) for name, layout in LAYOUTS.items()}
            rows.append((model_type, outcomes, ""))
            print(f"{model_type:28} " + " | ".join(f"{k} {v}" for k, v in outcomes.items()), flush=True)
    return rows


def write_table(rows: list, summary: str) -> None:
    lines = [f"| model type | {' | '.join(LAYOUTS)} | note |", "|---" * (len(LAYOUTS) + 2) + "|"]
    lines += [f"| {t} | {' | '.join(o[n] for n in LAYOUTS)} | {note.replace('|', '/')} |" for t, o, note in rows]
    path = Path(__file__).resolve().parents[1] / "docs" / "models.md"
    text = path.read_text()
    head = text.split("<!-- coverage table -->")[0]
    path.write_text(f"{head}<!-- coverage table -->\ntransformers {transformers.__version__}, {len(rows)} causal-LM "
                    f"types, {STEPS} steps each on 2 CPU ranks (gloo).\n\n{summary}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
