"""Retrieval maps: exact needle placement on the built inputs, scoring that a model right by construction passes
and a wrong one fails, chance for untrained models, the run / compare / HF paths, results and errors."""

import math
import re
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import TINY_RUN_WARNINGS
from hypothesis import given, settings
from hypothesis import strategies as st

from lengthgen.cli import main
from lengthgen.config import ConfigError
from lengthgen.data.needles import needle_source
from lengthgen.data.tasks import make_task
from lengthgen.data.text import make_text_data
from lengthgen.data.text.needle import ANSWER, NEEDLE, TextNeedles
from lengthgen.eval import (Comparison, NeedleCell, NeedleMap, Provenance, RunEval, answer_scores, check_needles,
                            evaluate, measure_needle_gpt, needle_map)
from lengthgen.model import GPT, GPTConfig
from lengthgen.report import write_report

g = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Byte-level text data of a few small local documents (fast to tokenize)."""
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (folder / f"doc{i}.txt").write_text("".join(f"line {i}.{j}: the quick brown fox é\n" for j in range(60)))
    return make_text_data(str(folder), "byte", split="all")


# ------------------------------------------------------------------ depth placement on the built inputs

@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 5), extra=st.integers(0, 60), depth=st.floats(0, 1), seed=st.integers(0, 99))
def test_passkey_needle_sits_exactly_at_its_depth(k, extra, depth, seed):
    task = make_task("passkey", num_digits=k)
    length = 2 * k + 1 + extra
    batch = task.at_depth(3, length, depth, g(seed))
    position = round(depth * (length - 2 * k - 1))
    assert (batch.extra["needle_pos"] == position).all()
    for row, target in zip(batch.tokens, batch.targets):
        assert (row == task.needle).nonzero().flatten().tolist() == [position]   # one needle, there
        digits = row[position + 1:position + 1 + k]
        assert row[length - k] == task.query and (target[length - k:] == digits).all()
        assert (row[length - k + 1:] == digits[:-1]).all()
    assert (batch.extra["answer"][batch.loss_mask] == 0).all() and (batch.extra["answer"][~batch.loss_mask] == -1).all()
    other = task.at_depth(3, length, 1 - depth, g(seed))         # the same haystack at another depth
    keep = torch.ones(length, dtype=torch.bool)
    for p in (position, int(other.extra["needle_pos"][0])):
        keep[p:p + k + 1] = False
    assert torch.equal(batch.tokens[:, keep], other.tokens[:, keep]) and torch.equal(batch.targets, other.targets)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(4, 131), needles=st.integers(1, 4), depth=st.floats(0, 1), seed=st.integers(0, 99))
def test_mqar_needles_sit_exactly_at_their_depth(length, needles, depth, seed):
    task = make_task("mqar", vocab_size=64)
    n = length // 4
    needles = min(needles, n)
    batch = task.at_depth(2, length, depth, g(seed), needles=needles)
    p = round(depth * (n - needles))
    assert (batch.extra["needle_pos"] == 2 * p).all()
    for row, target in zip(batch.tokens, batch.targets):
        pairs = dict(zip(row[:2 * n:2].tolist(), row[1:2 * n:2].tolist()))
        needle_keys = row[2 * p:2 * (p + needles):2].tolist()
        queries = row[2 * n:].tolist()
        assert queries == [needle_keys[j % needles] for j in range(length - 2 * n)]
        assert target[2 * n:].tolist() == [pairs[q] for q in queries]
    assert batch.extra["answer"][0, 2 * n:].tolist() == list(range(length - 2 * n))
    sample = task.sample(2, length, g(seed))                      # the same pairs as `sample` draws, reordered
    assert sorted(sample.tokens[0, :2 * n:2].tolist()) == sorted(batch.tokens[0, :2 * n:2].tolist())


@settings(max_examples=15, deadline=None)
@given(depth=st.floats(0, 1), needles=st.integers(1, 3), extra=st.integers(1, 300), seed=st.integers(0, 99))
def test_text_needles_sit_exactly_at_their_depth(text, depth, needles, extra, seed):
    length = 98 * needles + extra          # the needles, queries and answers take 98 tokens each, BOS one more
    batch = TextNeedles(text, depth, needles).sample(2, length, g(seed))
    other = TextNeedles(text, 1 - depth, needles).sample(2, length, g(seed))
    for i in range(2):
        row = bytes(batch.tokens[i, 1:].tolist()).decode("utf-8", "replace")
        found = re.findall(r"\nThe passkey for ([a-z]{6}) is (\d{5})\.\n", row)
        block = "".join(NEEDLE.format(key=k, value=v) for k, v in found)
        assert len(found) == needles and batch.tokens[i, 0] == text.bos_id
        filler = length - len(block) - len(found) * (len(f"\nWhat is the passkey for {'x' * 6}? The passkey for "
                                                          f"{'x' * 6} is") + len(ANSWER.format(value="0" * 5)))
        position = 1 + round(depth * filler)
        assert batch.extra["needle_pos"][i] == position
        assert bytes(batch.tokens[i, position:position + len(block)].tolist()).decode() == block
        answers = bytes(batch.targets[i][batch.loss_mask[i]].tolist()).decode()
        assert answers == "".join(ANSWER.format(value=v) for _, v in found)
        assert batch.extra["answer"][i][batch.loss_mask[i]].tolist() == [j for j in range(needles) for _ in range(6)]
        rest = lambda b, p: torch.cat([b.tokens[i, :p], b.tokens[i, p + len(block):]])  # noqa: E731
        assert torch.equal(rest(batch, position), rest(other, int(other.extra["needle_pos"][i])))


# ------------------------------------------------------------------ scoring: right by construction, wrong, chance

class Oracle(nn.Module):
    """A model with `GPT`'s evaluation interface whose logits put 20 on the token ``predict(tokens)`` names."""

    def __init__(self, vocab: int, predict):
        super().__init__()
        self.vocab, self.predict = vocab, predict
        self.anchor = nn.Parameter(torch.zeros(1))

    def features(self, tokens, doc_ids=None):
        return 20 * F.one_hot(self.predict(tokens), self.vocab).float()

    def head_logits(self, hidden):
        return hidden

    def forward(self, input_ids, use_cache=False):   # the transformers interface, for measure_needle_hf
        return types.SimpleNamespace(logits=self.features(input_ids))


def passkey_rule(task, wrong_after=None):
    """Copy the digits after NEEDLE after QUERY; from digit ``wrong_after`` on, one more than the right digit."""
    def predict(tokens):
        out = torch.zeros_like(tokens)
        k, length = task.num_digits, tokens.shape[1]
        for row, pred in zip(tokens, out):
            at = int((row == task.needle).nonzero()[0])
            digits = row[at + 1:at + 1 + k].clone()
            if wrong_after is not None:
                digits[wrong_after:] = (digits[wrong_after:] + 1) % 10
            pred[length - k:] = digits
        return out
    return predict


def mqar_rule(wrong_key_index=None):
    """Look up each query's value among the pairs; wrong (another value) for the ``wrong_key_index``-th needle."""
    def predict(tokens):
        out = torch.zeros_like(tokens)
        n = tokens.shape[1] // 4
        for row, pred in zip(tokens, out):
            pairs = dict(zip(row[:2 * n:2].tolist(), row[1:2 * n:2].tolist()))
            order = list(dict.fromkeys(row[2 * n:].tolist()))
            for t in range(2 * n, tokens.shape[1]):
                key = int(row[t])
                value = pairs[key]
                wrong = wrong_key_index is not None and order.index(key) == wrong_key_index
                pred[t] = 32 + (value - 32 + 1) % 32 if wrong else value     # values are 32..63 (vocab 64)
        return out
    return predict


def text_rule(tokens):
    """Read every needle sentence, and after each query's "? The passkey for KEY is" predict " VALUE"."""
    out = torch.zeros_like(tokens)
    for row, pred in zip(tokens, out):
        data = bytes(t if t < 256 else 0 for t in row.tolist())
        values = dict(re.findall(rb"\nThe passkey for ([a-z]{6}) is (\d{5})\.\n", data))
        for query in re.finditer(rb"\? The passkey for ([a-z]{6}) is", data):
            for i, byte in enumerate(b" " + values[query.group(1)]):
                if query.end() - 1 + i < len(row):
                    pred[query.end() - 1 + i] = byte
    return out


def test_a_model_right_by_construction_scores_100_percent(text):
    task = make_task("passkey", num_digits=3)
    right = needle_map(Oracle(task.vocab_size, passkey_rule(task)), task, [16, 40], [0, 0.5, 1], samples=8,
                       progress=False)
    assert all(c.exact_match == 1 and c.token_accuracy == 1 and c.answer_loss < 1e-3 for c in right.cells)
    assert len(right.cells) == 6 and {(c.depth, c.length) for c in right.cells} == {
        (d, n) for d in (0, 0.5, 1) for n in (16, 40)}
    mqar = make_task("mqar", vocab_size=64)
    assert all(c.exact_match == 1 for c in needle_map(Oracle(64, mqar_rule()), mqar, [24, 64], [0, 1], needles=3,
                                                      samples=4, progress=False).cells)
    bytes_model = Oracle(text.vocab_size, text_rule)
    assert all(c.exact_match == 1 for c in needle_map(bytes_model, text, [200, 400], [0, 0.3, 1], needles=2,
                                                      samples=3, progress=False).cells)


def test_exact_match_needs_every_token_of_every_answer():
    task = make_task("passkey", num_digits=4)
    half = needle_map(Oracle(task.vocab_size, passkey_rule(task, wrong_after=2)), task, [20], [0.5], samples=6,
                      progress=False).cells[0]
    assert half.exact_match == 0 and half.token_accuracy == pytest.approx(0.5)
    wrong = needle_map(Oracle(task.vocab_size, passkey_rule(task, wrong_after=0)), task, [20], [0.5], samples=6,
                       progress=False).cells[0]
    assert wrong.exact_match == 0 and wrong.token_accuracy == 0 and wrong.answer_loss > 5
    mqar = make_task("mqar", vocab_size=64)      # 2 needles, every answer of the second one wrong: half the answers
    cell = needle_map(Oracle(64, mqar_rule(wrong_key_index=1)), mqar, [40], [0.5], needles=2, samples=5,
                      progress=False).cells[0]
    assert cell.exact_match == pytest.approx(0.5) and cell.token_accuracy == pytest.approx(0.5)


def test_a_non_finite_output_is_wrong_with_infinite_loss_not_the_nans_index():
    """argmax returns a NaN's index: a diverged model (NaN logits) was scored right on every answer token 0,
    above chance on passkey; greedy decoding refuses such logits, so the answers are wrong."""
    task = make_task("passkey", num_digits=2)
    batch = task.at_depth(4, 20, 0.5, g(0))
    logits = F.one_hot(batch.targets[batch.loss_mask], task.vocab_size).float() * 20   # right by construction
    logits[1, 0] = math.nan                          # row 0's second answer token
    with pytest.warns(UserWarning, match="not finite at 1 of 8 answer tokens"):
        scores = answer_scores(logits, batch)
    assert scores["exact_match"].tolist() == [0, 1, 1, 1] and scores["token_accuracy"].tolist() == [0.5, 1, 1, 1]
    assert scores["answer_loss"][0] == math.inf and bool((scores["answer_loss"][1:] < 1e-3).all())
    one = make_task("passkey", num_digits=1)
    model = GPT(GPTConfig(vocab_size=one.vocab_size, dim=16, layers=1, heads=2))
    with torch.no_grad():
        model.head.weight.fill_(math.nan)
    with pytest.warns(UserWarning, match="not finite"):
        cells = needle_map(model, one, [16], [0, 1], samples=50, progress=False).cells
    assert all(c.exact_match == 0 and c.token_accuracy == 0 and c.answer_loss == math.inf for c in cells)


def test_untrained_models_score_at_most_chance_and_a_format_only_guess_scores_chance():
    task = make_task("passkey", num_digits=1, num_filler=8)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=32, layers=2, heads=2))
    cells = needle_map(model, task, [16, 48], [0, 0.5, 1], samples=200, progress=False).cells
    assert all(c.chance == pytest.approx({"exact_match": 0.1, "token_accuracy": 0.1, "answer_loss": math.log(10)})
               for c in cells)
    band = 4 * math.sqrt(0.1 * 0.9 / (200 * len(cells)))
    assert sum(c.exact_match for c in cells) / len(cells) <= 0.1 + band
    guess = Oracle(task.vocab_size, lambda tokens: torch.full_like(tokens, 7))   # the format, not the tokens
    cells = needle_map(guess, task, [16, 48], [0, 0.5, 1], samples=200, progress=False).cells
    assert abs(sum(c.exact_match for c in cells) / len(cells) - 0.1) <= band
    mqar = make_task("mqar", vocab_size=32)
    cell = needle_map(GPT(GPTConfig(vocab_size=32, dim=32, layers=1, heads=2)), mqar, [40], [0.5], samples=200,
                      progress=False).cells[0]
    assert cell.chance["exact_match"] == pytest.approx(1 / 16) and cell.exact_match <= 1 / 16 + 4 * math.sqrt(
        (1 / 16) * (15 / 16) / (200 * 20))


def test_gpt_scores_equal_the_full_forward_and_do_not_depend_on_chunking():
    task = make_task("passkey", num_digits=2)
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2)).eval()
    batch = task.at_depth(5, 30, 0.4, g(0))
    with torch.no_grad():
        full = answer_scores(model(batch.tokens)[batch.loss_mask], batch)
        fast = measure_needle_gpt(model, None, batch)
    assert all(torch.allclose(full[k], fast[k]) for k in full)
    whole = needle_map(model, task, [30, 60], [0, 1], samples=6, progress=False)
    chunked = needle_map(model, task, [30, 60], [0, 1], samples=6, forward_tokens=30, progress=False)
    assert [c.answer_loss for c in whole.cells] == pytest.approx([c.answer_loss for c in chunked.cells], rel=1e-5)


def test_gpt_scores_under_autocast_take_float32_logits_as_greedy_decoding_does():
    """`GPT.generate` computes the head's logits outside autocast; bfloat16 logits (spacing 0.5 at 64) tie close
    answers and shift the answer loss."""
    task = make_task("passkey", num_digits=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2)).eval()
    with torch.no_grad():
        model.head.weight.mul_(300)                   # logits of tens: bfloat16 keeps 8 significant bits
    batch = task.at_depth(64, 24, 0.5, g(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = measure_needle_gpt(model, None, batch)
        hidden = model.features(batch.tokens)[batch.loss_mask]
        with torch.autocast("cpu", enabled=False):
            want = answer_scores(model.logits(hidden.float()), batch)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0)


def test_a_cell_is_the_evaluators_value_on_its_seeded_batch():
    task = make_task("passkey", num_digits=2)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2))
    cell = needle_map(model, task, [24], [0.25], samples=7, seed=3, progress=False).cells[0]
    row = evaluate(model, needle_source(task, 0.25), [24], tokens_per_length=7 * 24, seed=3, diagnostics=False,
                   measure=measure_needle_gpt).lengths[0]
    assert cell.samples == 7 and cell.answer_loss == row.at_length["answer_loss"]


# ------------------------------------------------------------------ errors

def test_bad_requests_are_one_line_errors_naming_the_value():
    with pytest.raises(ConfigError, match=r"^needles=2 is not valid; task 'passkey' holds at most 1"):
        make_task("passkey").at_depth(1, 40, 0.5, g(0), needles=2)
    with pytest.raises(ConfigError, match=r"^needles=2 is not valid; task 'passkey'"):   # not headed "lengths:"
        check_needles(make_task("passkey"), [40], [0, 1], 2)
    with pytest.raises(ConfigError, match=r"depths\[1\]=1.5 is not valid"):
        check_needles(make_task("passkey"), [64], [0, 1.5], 1)
    with pytest.raises(ConfigError, match=r"lengths: length 600 exceeds the data's maximum length 515"):
        check_needles(make_task("mqar"), [64, 600], [0, 1], 1)
    with pytest.raises(ConfigError, match=r"lengths: give at least one context length"):   # was UnboundLocalError
        needle_map(GPT(GPTConfig(vocab_size=32, dim=16, layers=1, heads=2)), make_task("passkey"), [], [0.5])
    with pytest.raises(ConfigError, match=r"'dyck' has no needles.*passkey, mqar"):
        check_needles(make_task("dyck"), [64], [0], 1)
    with pytest.raises(ConfigError, match=r"compare.needle_depths: lengths: length 8: .*minimum length 11"):
        check_needles(make_task("passkey"), [8], [0], 1, key="compare.needle_depths")
    model = GPT(GPTConfig(vocab_size=32, dim=16, layers=1, heads=2))
    for samples in (0, -3, 2.5):           # was named tokens_per_length, an argument the caller never gave
        with pytest.raises(ConfigError, match=rf"^samples={samples} is not valid; it must be an integer >= 1"):
            needle_map(model, make_task("passkey"), [16], [0.5], samples=samples, progress=False)
    # one length or depth not in a list was "TypeError: 'int' object is not iterable"; a length "32" was named as
    # passkey.length, an argument of the task's
    for lengths, depths, match in ((32, [0.5], r"^lengths=32 is not valid; it must be a list"),
                                   ([32], 0.5, r"^depths=0.5 is not valid; it must be a list"),
                                   (["32"], [0.5], r"^lengths\[0\]='32' is not valid; it must be an integer")):
        with pytest.raises(ConfigError, match=match):
            needle_map(model, make_task("passkey"), lengths, depths, samples=4, progress=False)


def test_samples_too_many_for_memory_are_refused_before_any_cell(monkeypatch):
    """Was a MemoryError at the longest length, after the shorter lengths' cells were computed (and lost), whose
    message named no --samples."""
    import importlib

    evaluate_module, needle_module = map(importlib.import_module, ("lengthgen.eval.evaluate", "lengthgen.eval.needle"))

    monkeypatch.setattr(evaluate_module, "available_memory", lambda: (64 * 8 * 1000, "host"))   # 1000 x 64 ids
    monkeypatch.setattr(needle_module, "evaluate", lambda *a, **k: pytest.fail("a cell was computed"))
    model = GPT(GPTConfig(vocab_size=32, dim=16, layers=1, heads=2))
    with pytest.raises(ConfigError, match=r"^samples=1000: evaluating length 64 \(1,?000 sequences\) needs at least "
                                          r".*; map fewer sequences per cell \(lengthgen needle --samples"):
        needle_map(model, make_task("passkey"), [16, 64], [0.5], samples=1000, progress=False)


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["needle", "--hf", str(tmp_path)]) == 2
    assert "give --out" in capsys.readouterr().err
    assert main(["needle"]) == 2
    assert "give a run folder" in capsys.readouterr().err
    assert main(["needle", str(tmp_path), "--train-length", "8", "--out", str(tmp_path / "m")]) == 2
    assert "--train-length marks an HF model's map" in capsys.readouterr().err


# ------------------------------------------------------------------ results, runs, compare, HF

def test_needle_maps_round_trip_alone_and_in_a_run(tmp_path):
    cells = [NeedleCell(d, n, 4, d / 2, 0.5, 1.0, {"exact_match": 0.1}) for n in (8, 16) for d in (0.0, 1.0)]
    nmap = NeedleMap("passkey", 1, [0.0, 1.0], [8, 16], cells, 0, Provenance.capture("cpu"), train_length=8)
    assert NeedleMap.load(nmap.save(tmp_path / "needle.json")) == nmap
    assert nmap.grid("exact_match") == [[0.0, 0.0], [0.5, 0.5]]
    run = RunEval([], 0, Provenance.capture("cpu"), needle=nmap)
    assert RunEval.load(run.save(tmp_path / "run.json")) == run
    with pytest.raises(Exception, match="holds a 'run' result, expected a 'needle'"):
        NeedleMap.load(tmp_path / "run.json")


@pytest.fixture(scope="module")
def passkey_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("passkey")
    assert main(["train", "--set", "data.task=passkey", "--set", "data.task_kwargs={num_digits=2}",
                 "--set", "data.length=16", "--set", "train.steps=2", "--set", "model.dim=16",
                 "--set", "model.layers=1",
                 "--set", "model.heads=2", "--set", "train.batch_size=4", "--set", "train.eval_batches=0",
                 "--out", str(out / "run"), "--no-progress"]) == 0
    return out / "run"


def test_needle_command_maps_a_run_into_its_folder(passkey_run, capsys):
    assert main(["needle", str(passkey_run), "--depths", "0,0.5,1", "--samples", "3", "--no-progress"]) == 0
    output = capsys.readouterr().out
    assert "| depth | 16 (1x) | 32 (2x) | 64 (4x) | 128 (8x) | 256 (16x) |" in output and "chance 0.01" in output
    nmap = NeedleMap.load(passkey_run / "needle.json")
    assert nmap.train_length == 16 and nmap.lengths == [16, 32, 64, 128, 256] and nmap.depths == [0, 0.5, 1]
    assert len(nmap.cells) == 15 and nmap.config["data"]["task"] == "passkey" and nmap.seed == 0
    assert (passkey_run / "needle.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Exact match" in (passkey_run / "needle.md").read_text()


def test_text_runs_hide_needles_in_their_corpus(tmp_path, capsys):
    assert main(["train", "--set", "data.kind=text", "--set", 'data.text={corpus="stdlib", tokenizer="byte"}',
                 "--set", "data.length=64", "--set", "train.steps=1", "--set", "model.dim=16",
                 "--set", "model.layers=1",
                 "--set", "model.heads=2", "--set", "train.batch_size=2", "--set", "train.eval_batches=0",
                 "--out", str(tmp_path / "lm"), "--no-progress"]) == 0
    assert main(["needle", str(tmp_path / "lm"), "--lengths", "64", "--depths", "0", "--out", str(tmp_path / "m")]) == 2
    assert "length 64: text needles: length 64 is too short" in capsys.readouterr().err
    assert main(["needle", str(tmp_path / "lm"), "--lengths", "128,256", "--depths", "0,1", "--samples", "2",
                 "--out", str(tmp_path / "m")]) == 0
    nmap = NeedleMap.load(tmp_path / "m" / "needle.json")
    assert nmap.source == "text:stdlib/val:byte" and all(c.chance == {} for c in nmap.cells)


@TINY_RUN_WARNINGS
def test_compare_adds_the_maps_to_its_report(tmp_path, capsys):
    from lengthgen.experiments.compare import base_config, run_compare

    tiny = ["data.task=passkey", "data.task_kwargs={num_digits=2}", "data.length=16", "train.steps=2", "model.dim=16",
            "model.layers=1", "model.heads=2", "train.batch_size=4", "compare.eval_tokens=64",
            "compare.eval_lengths=[16, 32]", "compare.needle_depths=[0, 1]", "compare.needle_samples=3"]
    results = run_compare(base_config(None, tiny), tmp_path / "c", variants=["baseline", "l2"], progress=False,
                          log=lambda _: None)
    assert all(run.needle.lengths == [16, 32] and run.needle.depths == [0, 1] for runs in results.variants.values()
               for run in runs)
    saved = Comparison.load(tmp_path / "c" / "results.json")
    assert [run.needle for run in saved.variants["l2"]] == [run.needle for run in results.variants["l2"]]
    report = (tmp_path / "c" / "report.md").read_text()
    assert "## Retrieval maps" in report and "| l2 |" in report and (tmp_path / "c" / "needle.png").is_file()
    write_report(results, tmp_path / "again")
    assert (tmp_path / "again" / "needle.png").is_file()
    assert main(["compare", "--task", "dyck", "--steps", "2", "--set", "compare.needle_depths=[0.5]",
                 "--out", str(tmp_path / "d")]) == 2
    assert "compare.needle_depths: 'dyck' has no needles" in capsys.readouterr().err
    assert not (tmp_path / "d" / "runs").exists()


def test_hf_maps_a_tiny_local_model(tmp_path, capsys):
    transformers = pytest.importorskip("transformers",
                                       reason="the HF path needs transformers (pip install -e '.[dev]')")
    from lengthgen.hf import load_local_model, measure_needle_hf

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=300)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    assert main(["needle", "--hf", str(tmp_path / "llama"), "--tokenizer", "byte", "--lengths", "200,400", "--depths",
                 "0,1", "--samples", "2", "--needles", "2", "--train-length", "200", "--out", str(tmp_path / "m"),
                 "--no-progress"]) == 0
    nmap = NeedleMap.load(tmp_path / "m" / "needle.json")
    assert nmap.config["hf_model"] == str(tmp_path / "llama") and nmap.needles == 2 and nmap.train_length == 200
    assert len(nmap.cells) == 4 and all(0 <= c.exact_match <= 1 for c in nmap.cells)
    model = load_local_model(tmp_path / "llama")
    data = make_text_data("stdlib", "byte", split="val")
    batch = TextNeedles(data, 0.5, 2).sample(2, 200, g(0))
    with torch.no_grad():
        fast = measure_needle_hf(model, None, batch)                  # the head on answer positions only
        full = answer_scores(model(input_ids=batch.tokens).logits[batch.loss_mask], batch)
        right = measure_needle_hf(Oracle(data.vocab_size, text_rule), None, batch)
    assert all(torch.allclose(fast[k], full[k], atol=1e-5) for k in full)
    assert right["exact_match"].tolist() == [1.0, 1.0]


def test_compare_needle_samples_without_depths_is_a_warning(tmp_path, capsys):
    """compare.needle_samples alone made no maps, silently."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")        # stops the comparison after its checks
    assert main(["compare", "--task", "passkey", "--steps", "2", "--set", "compare.needle_samples=5",
                 "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "warning: compare.needle_samples=5: no effect without compare.needle_depths" in err
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


def test_hf_lengths_beyond_a_learned_position_embedding_are_refused(tmp_path, capsys):
    """Was an IndexError traceback from GPT-2's position embedding (eval --hf and needle --hf)."""
    transformers = pytest.importorskip("transformers",
                                       reason="the HF path needs transformers (pip install -e '.[dev]')")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300, n_positions=128,
                                     bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    for command in (["needle", "--depths", "0", "--samples", "1", "--out", str(tmp_path / "m")],
                    ["eval", "--tokens", "400", "--out", str(tmp_path / "e.json")]):
        assert main([*command, "--hf", str(tmp_path / "gpt2"), "--tokenizer", "byte", "--lengths", "100,200"]) == 2
        err = capsys.readouterr().err
        assert ("error: lengths: length 200 is longer than the 128 positions of the learned position embedding of "
                "the model at") in err and "give lengths up to 128" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists() and not (tmp_path / "e.json").exists()
    from lengthgen.hf.eval import learned_positions, load_local_model

    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=300)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    assert learned_positions(load_local_model(tmp_path / "llama")) is None       # RoPE: any length


def test_a_bema_map_says_so_and_does_not_replace_the_live_map(tmp_path, capsys):
    """needle --bema wrote needle.json with nothing saying it was the BEMA weights', over the live weights' map."""
    assert main(["train", "--set", "data.task=passkey", "--set", "data.task_kwargs={num_digits=2}",
                 "--set", "data.length=16", "--set", "train.steps=3", "--set", "model.dim=16",
                 "--set", "model.layers=1", "--set", "model.heads=2", "--set", "train.batch_size=4",
                 "--set", "train.eval_batches=0",
                 "--set", "train.bema.enabled=true", "--set", "train.bema.tau=1", "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    cells = ["--lengths", "16", "--depths", "0", "--samples", "1", "--no-progress"]
    assert main(["needle", str(tmp_path / "run"), *cells]) == 0
    live = (tmp_path / "run" / "needle.json").read_bytes()
    assert main(["needle", str(tmp_path / "run"), *cells, "--bema"]) == 2
    assert ("holds a map of live weights (needle.json), which this map of BEMA weights would replace; choose another "
            "--out") in capsys.readouterr().err
    assert (tmp_path / "run" / "needle.json").read_bytes() == live
    assert not NeedleMap.load(tmp_path / "run" / "needle.json").bema
    assert main(["needle", str(tmp_path / "run"), *cells, "--bema", "--out", str(tmp_path / "b")]) == 0
    assert NeedleMap.load(tmp_path / "b" / "needle.json").bema
    assert "`, its BEMA weights, training length 16" in (tmp_path / "b" / "needle.md").read_text()
    assert main(["needle", str(tmp_path / "run"), *cells, "--out", str(tmp_path / "b")]) == 2
    assert "holds a map of BEMA weights" in capsys.readouterr().err
