"""Real data: text files, token ids and a task with answers, the same batches on the ranks and in one process.

Each data is a pure function of (seed, step), so every layout must match the one-process
reference on it as it does on the synthetic chain; a resumed run goes on with the next
unseen batch; a trained model's answers to the task are measured, not assumed.
"""
from __future__ import annotations

import os

import pytest
import torch

import lab
from kernels.contract.data_spec import DataKind, DataSpec
from kernels.train.task_data import IGNORE, ModularAddition, answer_accuracy
from kernels.train.token_data import TokenWindows, stream

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 6
MODEL = dict(layers=2, d_model=32, heads=4, d_ff=64, vocab=128, seq_len=16)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "two_cities.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def test_windows_are_a_pure_function_of_seed_and_step_and_cover_each_epoch():
    ids = torch.arange(1, 162)  # 161 ids: 10 windows of 16 + 1
    data, again = TokenWindows(ids, seq_len=16, seed=3), TokenWindows(ids, seq_len=16, seed=3)
    for step in (0, 1, 7):
        x, y = data.global_batch(step, 5)
        assert torch.equal(x, again.global_batch(step, 5)[0]) and torch.equal(y, x + 1)  # next-token targets
    firsts = torch.cat([data.global_batch(step, 5)[0][:, 0] for step in (0, 1)])  # one epoch: every window once
    assert sorted(firsts.tolist()) == [1 + 16 * w for w in range(10)]
    assert not torch.equal(data.global_batch(0, 5)[0], TokenWindows(ids, 16, seed=4).global_batch(0, 5)[0])


def test_text_is_tokenised_by_its_utf8_bytes(text_file):
    ids = stream(DataSpec(DataKind.TEXT, paths=(text_file,)))
    assert bytes(ids.tolist()).decode("utf-8") == TEXT


def test_the_task_scores_only_its_answers():
    task = ModularAddition(modulus=7, seq_len=15)
    x, y = task.global_batch(4, 3)  # 4 problems "a b = c" per sequence
    scored = y != IGNORE
    assert scored.sum().item() == 3 * 4 and bool((x[scored.nonzero(as_tuple=True)] == 7).all())  # after "="
    a, b = x[:, 0::4], x[:, 1::4]
    assert torch.equal(y[:, 2::4], (a + b) % 7)
    perfect = torch.nn.functional.one_hot(y.clamp(min=0), 9).float()
    assert answer_accuracy(perfect, y) == 1.0 and answer_accuracy(-perfect, y) < 0.5


def test_text_under_tp_and_dp_with_loss_parallel_matches_one_process(cluster, text_file):
    exp = lab.Experiment(cluster, lab.GPT(**MODEL), lab.Parallel(dp=2, tp=2, loss_parallel=True), global_batch=8,
                         steps=3, data=lab.Text(text_file))
    result, reference = exp.run(progress=False), exp.reference()
    assert result.losses == pytest.approx(reference.losses, rel=1e-4)
    assert result.config["data"]["kind"] == "text" and reference.losses[0] > reference.losses[-1]


@pytest.mark.slow  # fast tier: one data case per capability (above)
@pytest.mark.parametrize("layout", [dict(dp=4, zero=3), dict(pp=2, dp=2, microbatches=2),
                                    dict(pp=2, tp=2, schedule="interleaved_1f1b", microbatches=2)],
                         ids=["zero3-dp4", "pp2-dp2-1f1b", "pp2-tp2-interleaved"])
def test_token_ids_under_every_family_match_one_process(cluster, layout):
    ids = torch.randint(0, 100, (3000,), generator=torch.Generator().manual_seed(0))
    exp = lab.Experiment(cluster, lab.GPT(**{**MODEL, "layers": 4}), lab.Parallel(**layout), global_batch=8,
                         steps=3, data=lab.Tokens(ids))
    assert exp.run(progress=False).losses == pytest.approx(exp.reference().losses, rel=1e-4)


@pytest.mark.slow  # a save, then a resume under another layout
def test_a_resume_goes_on_with_the_next_unseen_batch_of_the_text(cluster, text_file, tmp_path):
    model = lab.GPT(**MODEL)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4), global_batch=8, steps=4, data=text_file)
    lab.Experiment(cluster, model, lab.Parallel(dp=4), global_batch=8, steps=2, data=text_file,
                   checkpoint_dir=str(tmp_path)).run(progress=False)
    resumed = lab.Experiment(cluster, model, lab.Parallel(dp=2, tp=2), global_batch=8, steps=4, data=text_file,
                             resume_from=str(tmp_path)).run(progress=False)
    assert resumed.first_step == 2
    assert resumed.losses == pytest.approx(whole.reference().losses[2:], rel=1e-4)


@pytest.mark.slow  # a second text case: the fast tier has the byte-level one
def test_a_tokenizer_file_tokenises_the_text_on_the_ranks_as_here(cluster, text_file, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train([text_file], trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    path = str(tmp_path / "tokenizer.json")
    tokenizer.save(path)
    data = lab.Text(text_file, tokenizer=path)
    assert stream(data.spec()).tolist() == tokenizer.encode(TEXT).ids
    exp = lab.Experiment(cluster, lab.GPT(**MODEL), lab.Parallel(dp=4, zero=2), global_batch=8, steps=2, data=data)
    assert exp.run(progress=False).losses == pytest.approx(exp.reference().losses, rel=1e-4)


def test_one_process_learns_modular_addition_and_its_accuracy_is_measured():
    # Measured: the loss sits at ln 5 for ~50 steps, then falls; 300 steps take 1.4 s and answer every problem.
    task, model = lab.ModularAddition(5), lab.GPT(layers=1, d_model=64, heads=4, d_ff=128, vocab=7, seq_len=15)
    exp = lab.Experiment(_OneRank(), model, lab.Parallel(), global_batch=32, steps=300, lr=5e-3, data=task)
    untrained = lab.Experiment(_OneRank(), model, lab.Parallel(), global_batch=32, steps=1, lr=1e-9, data=task)
    assert task.accuracy(model, untrained.reference(return_params=True)) < 0.5
    assert task.accuracy(model, exp.reference(return_params=True)) > 0.95


class _OneRank:
    """A pool of one rank that is never called: the reference runs in this process."""

    world_size = 1
    rank_map = None


def test_tokens_in_memory_are_written_once_by_content():
    ids = torch.arange(50)
    first, second = lab.Tokens(ids).spec(), lab.Tokens(ids.clone()).spec()
    assert first == second and os.path.isfile(first.paths[0])
    assert lab.Tokens(ids + 1).spec().paths != first.paths


def _rows(steps: int, batch: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (batch, MODEL["seq_len"] + 1), generator=g) for _ in range(steps)]


@pytest.mark.slow  # fast tier: the batches' refusal below; the data's layouts are covered above
def test_your_own_batches_are_trained_in_order_and_sharded_as_one_process_sees_them(cluster):
    """An iterable of (B, T+1) rows: step s trains on batch s, under PP2×DP2 as in one process; and the reference's
    first loss is the seeded model's loss on the first batch, not on any other."""
    rows = _rows(3)
    exp = lab.Experiment(cluster, lab.GPT(**MODEL), lab.Parallel(pp=2, dp=2, microbatches=2), global_batch=8,
                         steps=3, data=iter(rows))
    result, reference = exp.run(progress=False), exp.reference()
    assert result.config["data"]["kind"] == "batches"
    assert result.losses == pytest.approx(reference.losses, rel=1e-4)
    from kernels.model.family import build_model, model_config
    from kernels.contract.run_config import RunConfig
    from kernels.model.gpt import loss_fn
    model = build_model(model_config(RunConfig.from_dict(exp.config())))
    with torch.no_grad():
        on_first, on_second = (float(loss_fn(model(r[:, :-1]), r[:, 1:])) for r in rows[:2])
    assert reference.losses[0] == pytest.approx(on_first, rel=1e-6) and on_first != pytest.approx(on_second)


def test_batches_fewer_than_the_steps_are_refused_by_name(cluster):
    with pytest.raises(lab.ParallelConfigError, match=r"data-length.*holds 2 batches"):
        lab.Experiment(cluster, lab.GPT(**MODEL), lab.Parallel(dp=4), global_batch=8, steps=3, data=_rows(2))


def test_a_local_dataset_is_read_by_its_text_or_its_input_ids():
    datasets = pytest.importorskip("datasets")
    from lab.run.data_sources import data_spec
    text = datasets.Dataset.from_dict({"text": ["It was the best of times,", "it was the worst of times."]})
    spec = data_spec(text)
    assert spec.kind is DataKind.TEXT
    assert stream(spec).tolist() == list("It was the best of times,\nit was the worst of times.".encode())
    ids = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]})
    spec = data_spec(ids)
    assert spec.kind is DataKind.TOKENS and stream(spec).tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(lab.ConfigError, match="'input_ids' or 'text' column"):
        data_spec(datasets.Dataset.from_dict({"label": [0, 1]}))
