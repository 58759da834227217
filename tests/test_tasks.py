"""Synthetic tasks: labels against independent plain-Python computations, determinism, argument
errors, and perfect metrics for oracle outputs."""

from __future__ import annotations

import itertools
import math
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lengthgen.config import ConfigError
from lengthgen.data.tasks import TASKS, Batch, make_task, roc_auc

FEW = settings(max_examples=12, deadline=None)
SEEDS = st.integers(0, 2**31 - 1)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lm_oracle(batch: Batch, vocab_size: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(batch.targets, vocab_size).float() * 10


def nan_outside(metric: torch.Tensor, mask: torch.Tensor) -> bool:
    return bool(metric[~mask].isnan().all() and not metric[mask].isnan().any())


# ------------------------------------------------------------------ registry and argument errors

def test_registry():
    assert set(TASKS) == {"counting", "set_complement", "max_retrieval", "dyck", "tomita", "mqar",
                          "passkey"}
    for name, cls in TASKS.items():
        task = make_task(name)
        assert isinstance(task, cls) and task.name == name
        assert task.head in ("lm", "regress", "classify") and task.vocab_size > 0
        assert task.num_classes == (2 if task.head == "classify" else 0)


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match=r"'nope'.*counting.*tomita"):
        make_task("nope")


def test_unknown_kwarg_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"^dyck\.bogus is not a valid key; valid keys: num_types, max_depth$"):
        make_task("dyck", bogus=1)


@pytest.mark.parametrize("name, kwargs, bad", [
    ("counting", {"vocab_size": 1}, "vocab_size"),
    ("set_complement", {"num_tokens": 0}, "num_tokens"),
    ("max_retrieval", {"num_values": "8"}, "num_values"),
    ("dyck", {"max_depth": 0}, "max_depth"),
    ("tomita", {"grammar": 8}, "grammar"),
    ("tomita", {"near_miss": 1.5}, "near_miss"),
    ("mqar", {"vocab_size": 3}, "vocab_size"),
    ("passkey", {"num_digits": True}, "num_digits"),
    ("counting", {"vocab_size": 10**12}, "vocab_size"),
    ("set_complement", {"num_tokens": 10**9 * 3}, "num_tokens"),
    ("dyck", {"max_depth": 2**40}, "max_depth"),
])
def test_bad_kwarg_values(name, kwargs, bad):
    with pytest.raises(ConfigError, match=rf"^{name}\.{bad}={kwargs[bad]!r} is not valid; it must be "):
        make_task(name, **kwargs)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_impossible_lengths(name):
    task = make_task(name)
    with pytest.raises(ValueError, match=rf"'{name}'.*length 0 .*minimum"):
        task.sample(2, 0, gen(0))
    if task.max_length is not None:
        too_long = task.max_length + 1
        with pytest.raises(ValueError, match=rf"'{name}'.*length {too_long} .*maximum length {task.max_length}"):
            task.sample(2, too_long, gen(0))
    with pytest.raises(ConfigError, match=rf"^{name}\.batch_size=0 is not valid; it must be an integer >= 1$"):
        task.sample(0, 16, gen(0))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_generator_that_is_none_is_named(name):
    """sample(..., generator=None) was "AttributeError: 'NoneType' object has no attribute 'device'"."""
    with pytest.raises(ConfigError, match=rf"^{name}\.generator=None is not valid; it must be a torch.Generator"):
        make_task(name).sample(2, 16, None)


def test_minimum_lengths():
    with pytest.raises(ValueError, match=r"'passkey'.*length 10 .*minimum length 11"):
        make_task("passkey", num_digits=5).sample(2, 10, gen(0))
    with pytest.raises(ValueError, match=r"'tomita'.*length 4 .*minimum length 5"):
        make_task("tomita", grammar=7).sample(2, 4, gen(0))
    assert make_task("tomita", grammar=7).sample(2, 5, gen(0)).tokens.shape == (2, 5)


# ------------------------------------------------------------------ every task: shapes, determinism

@pytest.mark.parametrize("name", sorted(TASKS))
@FEW
@given(data=st.data(), seed=SEEDS)
def test_shapes_and_determinism(name, data, seed):
    task = make_task(name)
    length = data.draw(st.integers(task.min_length, min(task.max_length or 300, 300)))
    a, b = task.sample(3, length, gen(seed)), task.sample(3, length, gen(seed))
    assert a.tokens.shape == a.loss_mask.shape == (3, length)
    assert a.tokens.dtype == torch.long and a.loss_mask.dtype == torch.bool
    assert a.targets.shape == ((3,) if task.head == "classify" else (3, length))
    assert a.targets.dtype == (torch.float32 if task.head == "regress" else torch.long)
    assert 0 <= int(a.tokens.min()) and int(a.tokens.max()) < task.vocab_size
    assert a.loss_mask.any(1).all()
    for x, y in [(a.tokens, b.tokens), (a.targets, b.targets), (a.loss_mask, b.loss_mask)]:
        assert torch.equal(x, y)
    assert a.extra.keys() == b.extra.keys()
    assert all(torch.equal(a.extra[k], b.extra[k]) for k in a.extra)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_samples_follow_the_generator(name):
    task = make_task(name)
    g = gen(0)
    first, second, other = task.sample(8, 40, g), task.sample(8, 40, g), task.sample(8, 40, gen(1))
    assert not torch.equal(first.tokens, second.tokens) and not torch.equal(first.tokens, other.tokens)


class Work(TorchDispatchMode):
    """Counts the tensor ops and the Python lines run in lengthgen's code while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.lines = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))

    def _trace(self, frame, event, arg):
        if "lengthgen" not in frame.f_code.co_filename:
            return None
        if event == "line":
            self.lines += 1
        return self._trace

    def __enter__(self):
        sys.settrace(self._trace)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.settrace(None)
        return super().__exit__(*exc)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_samplers_have_no_python_loop_over_positions(name):
    """Long batches are cheap because sampling is vectorized: 4x the length adds fewer tensor ops and fewer lines
    of lengthgen code than positions (a log-depth scan adds a few per doubling; a loop adds one or more each)."""
    task = make_task(name)
    long = min(task.max_length or 4096, 4096)
    task.sample(2, long, gen(0))              # fills the per-length tables a sampler caches (tomita's path counts)
    work = {}
    for length in (long // 4, long):
        with Work() as work[length]:
            batch = task.sample(16, length, gen(1))
        assert batch.tokens.shape == (16, length)
    short = long // 4
    assert work[long].ops - work[short].ops < long - short
    assert work[long].lines - work[short].lines < long - short


# ------------------------------------------------------------------ counting

@FEW
@given(length=st.integers(1, 200), vocab_size=st.integers(2, 40), seed=SEEDS)
def test_counting_labels_are_running_sums(length, vocab_size, seed):
    task = make_task("counting", vocab_size=vocab_size)
    batch = task.sample(4, length, gen(seed))
    assert batch.loss_mask.all()
    for tokens, labels in zip(batch.tokens.tolist(), batch.targets.tolist()):
        expected = [0.0] + [float(sum(tok == tokens[0] for tok in tokens[1:t + 1])) for t in range(1, length)]
        assert labels == expected


def test_counting_metrics():
    task = make_task("counting")
    batch = task.sample(4, 300, gen(0))
    perfect = task.metrics(batch.targets.clone(), batch)
    assert perfect["abs_error"].abs().max() == 0 and perfect["rel_error"].abs().max() == 0
    off = task.metrics(batch.targets + 2, batch)
    assert torch.allclose(off["abs_error"], torch.full_like(batch.targets, 2.0))
    assert torch.allclose(off["rel_error"], 2 / batch.targets.clamp(min=1))


# ------------------------------------------------------------------ set complement

def python_unseen(tokens: list[int], num_tokens: int) -> list[set[int]]:
    seen: set[int] = set()
    unseen = []
    for tok in tokens[1:] + [None]:
        unseen.append(set(range(num_tokens)) - seen)
        seen.add(tok)
    return unseen


@FEW
@given(num_tokens=st.integers(2, 40), data=st.data(), seed=SEEDS)
def test_set_complement_sequences_and_oracle(num_tokens, data, seed):
    task = make_task("set_complement", num_tokens=num_tokens)
    length = data.draw(st.integers(1, num_tokens))
    batch = task.sample(4, length, gen(seed))
    logits = torch.full((4, length, task.vocab_size), -1e4)
    for b, (tokens, targets) in enumerate(zip(batch.tokens.tolist(), batch.targets.tolist())):
        assert tokens[0] == num_tokens and len(set(tokens[1:])) == length - 1 == len(tokens[1:])
        assert tokens[1:] == targets[:-1]
        for t, unseen in enumerate(python_unseen(tokens, num_tokens)):
            assert targets[t] in unseen
            logits[b, t, sorted(unseen)] = 0.0
    tvd = task.metrics(logits, batch)["tvd"]
    assert tvd.shape == (4, length) and tvd.abs().max() < 1e-5


def test_set_complement_tvd_matches_python():
    task = make_task("set_complement", num_tokens=12)
    batch = task.sample(3, 12, gen(5))
    logits = torch.randn(3, 12, 13, generator=gen(6))
    tvd = task.metrics(logits, batch)["tvd"]
    for b, tokens in enumerate(batch.tokens.tolist()):
        for t, unseen in enumerate(python_unseen(tokens, 12)):
            probs = logits[b, t].softmax(-1).tolist()
            expected = 0.5 * sum(abs(p - (1 / len(unseen) if x in unseen else 0.0)) for x, p in enumerate(probs))
            assert math.isclose(tvd[b, t].item(), expected, abs_tol=1e-5)
    everything_seen = Batch(batch.tokens, batch.targets, batch.loss_mask,
                            extra={"first_pos": torch.zeros_like(batch.extra["first_pos"])})
    assert task.metrics(logits, everything_seen)["tvd"].isnan().all()


# ------------------------------------------------------------------ max retrieval

@FEW
@given(num_keys=st.integers(1, 60), num_values=st.integers(2, 9), data=st.data(), seed=SEEDS)
def test_max_retrieval_answer_is_python_max(num_keys, num_values, data, seed):
    task = make_task("max_retrieval", num_keys=num_keys, num_values=num_values)
    length = data.draw(st.integers(3, task.max_length))
    batch = task.sample(4, length, gen(seed))
    for tokens, targets in zip(batch.tokens.tolist(), batch.targets.tolist()):
        assert tokens[-1] == task.query
        body = tokens[:-1]
        if length % 2 == 0:
            assert body[0] == task.pad
            body = body[1:]
        keys, values = body[0::2], body[1::2]
        assert len(keys) == len(set(keys)) == (length - 1) // 2 and all(0 <= k < num_keys for k in keys)
        assert all(num_keys <= v < num_keys + num_values for v in values)
        assert targets[-1] == dict(zip(keys, values))[max(keys)]
    assert batch.loss_mask[:, -1].all() and not batch.loss_mask[:, :-1].any()
    accuracy = task.metrics(lm_oracle(batch, task.vocab_size), batch)["accuracy"]
    assert nan_outside(accuracy, batch.loss_mask) and (accuracy[:, -1] == 1).all()


# ------------------------------------------------------------------ Dyck

@FEW
@given(num_types=st.integers(1, 3), max_depth=st.integers(1, 6), length=st.integers(1, 150), seed=SEEDS)
def test_dyck_prefixes_and_legal_mask_match_a_stack(num_types, max_depth, length, seed):
    task = make_task("dyck", num_types=num_types, max_depth=max_depth)
    batch = task.sample(4, length, gen(seed))
    assert batch.loss_mask.all()
    for tokens, targets, legal in zip(batch.tokens.tolist(), batch.targets.tolist(),
                                      batch.extra["legal"].tolist()):
        assert tokens[0] == 2 * num_types and tokens[1:] == targets[:-1]
        stack: list[int] = []
        for t, nxt in enumerate(targets):
            expected = set(range(num_types)) if len(stack) < max_depth else set()
            if stack:
                expected.add(num_types + stack[-1])
            assert {x for x, ok in enumerate(legal[t]) if ok} == expected
            assert nxt in expected
            if nxt < num_types:
                stack.append(nxt)
            else:
                assert stack.pop() == nxt - num_types
            assert 0 <= len(stack) <= max_depth


def test_dyck_depth_bound_beyond_the_length_costs_nothing():
    """Only depths a prefix can reach are walked: a huge max_depth samples as fast as the length allows, and a
    depth bound never reached gives the same brackets as any other unreached bound."""
    huge, reached_never = make_task("dyck", max_depth=2**31 - 1), make_task("dyck", max_depth=64)
    assert torch.equal(huge.sample(4, 64, gen(0)).tokens, reached_never.sample(4, 64, gen(0)).tokens)
    # its law and chance levels too: the same as any bound the length never reaches (a huge one allocated 2m)
    torch.testing.assert_close(huge.depth_law(64), reached_never.depth_law(64))
    for metric in ("tvd", "legal_accuracy", "loss"):
        torch.testing.assert_close(huge.chance(metric, 64), reached_never.chance(metric, 64))


def test_dyck_visits_every_depth_and_metric():
    task = make_task("dyck", num_types=2, max_depth=4)
    batch = task.sample(8, 400, gen(3))
    depth = (batch.targets < 2).long().mul(2).sub(1).cumsum(1)
    assert set(depth.unique().tolist()) == {0, 1, 2, 3, 4}
    always_bos = torch.nn.functional.one_hot(torch.full_like(batch.tokens, task.bos), task.vocab_size)
    for output, expected in [(lm_oracle(batch, task.vocab_size), 1), (batch.extra["legal"].float(), 1),
                             (always_bos.float(), 0)]:
        assert (task.metrics(output, batch)["legal_accuracy"] == expected).all()


@pytest.mark.parametrize("num_types, max_depth", [(1, 2), (2, 3), (3, 1)])
def test_dyck_next_token_law_is_the_samplers(num_types, max_depth):
    """Grouped by its legal set and stack top (the sampler's state), the next token's frequencies match
    `next_token_law` within 5 standard errors; the law sums to 1 over the legal tokens."""
    task = make_task("dyck", num_types=num_types, max_depth=max_depth)
    batch = task.sample(4000, 30, gen(0))
    law = task.next_token_law(batch.extra["legal"])
    torch.testing.assert_close(law.sum(-1), torch.ones(law.shape[:2]))
    assert ((law > 0) == batch.extra["legal"]).all()
    states, group = batch.extra["legal"].flatten(0, 1).unique(dim=0, return_inverse=True)
    observed = torch.nn.functional.one_hot(batch.targets.flatten(), task.vocab_size).double()
    for g in range(len(states)):
        rows = group == g
        p = law.flatten(0, 1)[rows][0].double()
        freq = observed[rows].mean(0)
        stderr = (p * (1 - p) / rows.sum()).sqrt()
        assert ((freq - p).abs() <= 5 * stderr + 1e-12).all(), (states[g], freq, p)


def test_dyck_tvd_is_zero_for_the_law_and_one_off_it():
    task = make_task("dyck", num_types=2, max_depth=3)
    batch = task.sample(8, 50, gen(1))
    law = task.next_token_law(batch.extra["legal"])
    assert task.metrics(law.log(), batch)["tvd"].abs().max() < 1e-6          # softmax(log p) = p
    always_bos = torch.nn.functional.one_hot(torch.full_like(batch.tokens, task.bos), task.vocab_size).float()
    torch.testing.assert_close(task.metrics(always_bos * 1e4, batch)["tvd"], torch.ones(8, 50))
    # uniform over the vocabulary: 1 - sum(min(p, 1/V)), by hand
    expected = 1 - law.clamp(max=1 / task.vocab_size).sum(-1)
    torch.testing.assert_close(task.metrics(torch.zeros_like(law), batch)["tvd"], expected)


def test_dyck_metrics_of_a_model_with_a_larger_vocabulary():
    """model.vocab_size may exceed the task's (training allows it): ids beyond the task's are never legal, and
    mass on them counts as error, like mass on BOS."""
    task = make_task("dyck", num_types=2, max_depth=3)
    batch = task.sample(8, 50, gen(1))
    law = task.next_token_law(batch.extra["legal"])
    wide = torch.nn.functional.pad(law, (0, 3))                      # 3 ids the task never uses
    metrics = task.metrics(wide.log(), batch)
    assert metrics["tvd"].abs().max() < 1e-6
    assert (metrics["legal_accuracy"] == 1).all()
    beyond = torch.nn.functional.one_hot(torch.full_like(batch.tokens, task.vocab_size + 2), task.vocab_size + 3)
    metrics = task.metrics(beyond.float() * 1e4, batch)
    torch.testing.assert_close(metrics["tvd"], torch.ones(8, 50))
    assert (metrics["legal_accuracy"] == 0).all()


# ------------------------------------------------------------------ Tomita

def tomita_reference(grammar: int, s: str) -> bool:
    if grammar == 1:
        return re.fullmatch("1*", s) is not None
    if grammar == 2:
        return re.fullmatch("(10)*", s) is not None
    if grammar == 3:                    # no odd run of 0s anywhere after an odd run of 1s (runs maximal)
        odd_ones = False
        for ch, group in itertools.groupby(s):
            odd = len(list(group)) % 2 == 1
            if ch == "0" and odd and odd_ones:
                return False
            odd_ones |= ch == "1" and odd
        return True
    if grammar == 4:
        return "000" not in s
    if grammar == 5:
        return s.count("0") % 2 == 0 and s.count("1") % 2 == 0
    if grammar == 6:
        return (s.count("0") - s.count("1")) % 3 == 0
    return re.fullmatch("0*1*0*1*", s) is not None


def decode(tokens: list[int]) -> str:
    """BOS, optional PADs, then the bits."""
    assert tokens[0] == 2
    bits = "".join(map(str, tokens[1:])).lstrip("3")
    assert set(bits) <= {"0", "1"}
    return bits


#: Tomita's (1982) training strings, accepted and rejected, of each grammar
TOMITA_EXAMPLES = {
    1: ("1 11 111 1111 11111 111111 1111111 11111111 1111111111", "0 00 10 01 011 110 0000 11111110 10111111"),
    2: ("10 1010 101010 10101010 10101010101010 10101010101010101010",
        "1 0 11 00 01 101 100 1001010 10110 110101010"),
    3: ("1 0 01 11 00 100 110 111 000 100100 110000011100001 111101100010011100",
        "10 101 010 1010 1110 1011 10001 111010 1001000 11111000 0111001101 11011100110"),
    4: ("1 0 10 01 00 100100 001111110100 0100100100 11100 010",
        "000 11000 0001 000000000 11111000011 1101010000010111 1010010001 0000 00000"),
    5: ("11 00 1001 0101 1010 1000111101 1001100001111010 111111 0000",
        "0 111 011 000000000 1000 01 10 1110010100 010111111110 0001"),
    6: ("10 01 1100 101010 111 000000 10111 0111101111 100100100",
        "1 0 11 00 101 011 11001 1111 00000000 010111 10111101111 1001001001"),
    7: ("1 0 10 01 11111 000 00110011 0101 0000100001111 00100 011111011111 00",
        "1010 00110011000 0101010101 1011010 10101 010100 101001 100100110101"),
}


@pytest.mark.parametrize("grammar", range(1, 8))
def test_tomita_dfa_labels_tomitas_own_examples(grammar):
    """Grammar 3 once rejected only an odd 1-run *immediately* followed by an odd 0-run, and so accepted two of
    Tomita's rejected strings (0111001101, 11011100110)."""
    task = make_task("tomita", grammar=grammar)
    transitions, accepting = task.transitions.tolist(), task.accepting.tolist()

    def accepts(s: str) -> bool:
        state = 0
        for bit in s:
            state = transitions[state][int(bit)]
        return accepting[state]

    accepted, rejected = (words.split() for words in TOMITA_EXAMPLES[grammar])
    assert [s for s in accepted if not accepts(s)] == [] and [s for s in rejected if accepts(s)] == []
    assert all(tomita_reference(grammar, s) for s in accepted) and not any(tomita_reference(grammar, s)
                                                                           for s in rejected)


@pytest.mark.parametrize("grammar", range(1, 8))
def test_tomita_dfa_matches_reference_on_all_short_strings(grammar):
    task = make_task("tomita", grammar=grammar)
    transitions, accepting = task.transitions.tolist(), task.accepting.tolist()
    for n in range(13):
        for bits in itertools.product((0, 1), repeat=n):
            state = 0
            for bit in bits:
                state = transitions[state][bit]
            assert accepting[state] == tomita_reference(grammar, "".join(map(str, bits)))


@pytest.mark.parametrize("grammar", range(1, 8))
@pytest.mark.parametrize("length, batch_size", [(34, 256), (1024, 64)])
def test_tomita_labels_and_balance(grammar, length, batch_size):
    task = make_task("tomita", grammar=grammar)
    batch = task.sample(batch_size, length, gen(grammar))
    strings = [decode(tokens) for tokens in batch.tokens.tolist()]
    assert len({len(s) for s in strings}) == 1
    if grammar in (2, 5):                                  # no positives of odd length: one PAD
        assert len(strings[0]) == 2 * ((length - 1) // 2)
    else:
        assert len(strings[0]) == length - 1
    assert [tomita_reference(grammar, s) for s in strings] == batch.targets.bool().tolist()
    assert int(batch.targets.sum()) == batch_size // 2                  # half of every batch, in random order
    assert 0 < int(batch.targets[: batch_size // 2].sum()) < batch_size // 2
    assert batch.loss_mask.all()


def test_tomita_odd_batches_hold_both_classes_and_half_positives_on_average():
    task = make_task("tomita", grammar=4)
    counts = [int(task.sample(3, 10, gen(seed)).targets.sum()) for seed in range(200)]
    assert set(counts) == {1, 2}                                       # both classes in every batch of 3
    assert abs(sum(counts) / len(counts) - 1.5) < 4 * 0.5 / math.sqrt(len(counts))   # 1 or 2, each half the time


@pytest.mark.parametrize("grammar", [1, 2, 5, 6])
def test_tomita_near_misses_are_one_flip_from_accepted(grammar):
    task = make_task("tomita", grammar=grammar, near_miss=1.0)
    batch = task.sample(64, 40, gen(0))
    for s, label in zip((decode(t) for t in batch.tokens.tolist()), batch.targets.tolist()):
        if not label:
            flips = (s[:i] + "10"[int(s[i])] + s[i + 1:] for i in range(len(s)))
            assert any(tomita_reference(grammar, f) for f in flips)


def test_tomita_metrics_and_roc_auc():
    task = make_task("tomita", grammar=3)
    batch = task.sample(64, 50, gen(1))
    logits = torch.nn.functional.one_hot(batch.targets, 2).float() * 5
    out = task.metrics(logits, batch)
    assert out["accuracy"].shape == out["score"].shape == (64,)
    assert (out["accuracy"] == 1).all() and roc_auc(out["score"], batch.targets) == 1.0
    assert roc_auc(1 - out["score"], batch.targets) == 0.0
    assert task.batch_metrics(out, batch) == {"roc_auc": 1.0} and task.metric == "roc_auc"   # the seed's metric
    # a diverged model's NaN scores have no ranking: NaN, not 0 or 1 by the order of the labels
    assert math.isnan(roc_auc(torch.full((4,), math.nan), torch.tensor([0, 1, 1, 0])))
    assert math.isnan(roc_auc(torch.tensor([0.2, math.nan, 0.9, 0.1]), torch.tensor([0, 1, 1, 0])))


def test_the_evaluator_reports_a_whole_batch_metric_once_per_length():
    """Tomita's headline ROC AUC is a metric of the whole evaluation batch: the evaluator's value at each
    length equals roc_auc of that batch's scores, also when the batch is measured in several forward passes."""
    from lengthgen.eval import evaluate
    from lengthgen.eval.evaluate import eval_generator
    from lengthgen.model import GPT, GPTConfig

    task = make_task("tomita", grammar=4)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, heads=2, layers=1, head="classify", num_classes=2))
    result = evaluate(model, task, [12, 24], tokens_per_length=24 * 40, seed=3, forward_tokens=24 * 7,
                      diagnostics=False)
    for row in result.lengths:
        batch = task.sample(row.batch_size, row.length, eval_generator(3, row.length))
        with torch.no_grad():
            logits = model(batch.tokens).float()
        scores = logits[:, 1] - logits[:, 0]
        want = roc_auc(scores, batch.targets)
        assert 0 < want < 1 and row.at_length["roc_auc"] == pytest.approx(want, abs=1e-6)
        assert row.mean["roc_auc"] == row.at_length["roc_auc"] and row.chance["roc_auc"] == 0.5


def test_tomita_roc_auc_ranks_confident_sequences_by_their_margin():
    """P(accept) rounds to 1 in float32 beyond a logit margin of about 17: a confident model that ranks every
    accepted string above every rejected one scored ROC AUC 1/2, the chance level, from tied scores."""
    task = make_task("tomita", grammar=4)
    batch = task.sample(64, 20, gen(0))
    margin = torch.where(batch.targets.bool(), 30.0, 20.0) + torch.rand(64, generator=gen(1))
    values = task.metrics(torch.stack([torch.zeros(64), margin], 1), batch)
    assert task.batch_metrics(values, batch) == {"roc_auc": 1.0}
    torch.testing.assert_close(values["score"], margin)


@FEW
@given(scores=st.lists(st.integers(0, 4), min_size=2, max_size=30), seed=SEEDS)
def test_roc_auc_matches_pairwise_count(scores, seed):
    labels = torch.randint(2, (len(scores),), generator=gen(seed)).tolist()
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    got = roc_auc(torch.tensor(scores, dtype=torch.float), torch.tensor(labels))
    if not pos or not neg:
        assert math.isnan(got)
    else:
        wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
        assert math.isclose(got, wins / (len(pos) * len(neg)))


# ------------------------------------------------------------------ MQAR

@FEW
@given(vocab_size=st.integers(4, 80), data=st.data(), seed=SEEDS)
def test_mqar_answers_are_dict_lookups(vocab_size, data, seed):
    task = make_task("mqar", vocab_size=vocab_size)
    length = data.draw(st.integers(4, task.max_length))
    batch = task.sample(4, length, gen(seed))
    n = length // 4
    for tokens, targets, mask in zip(batch.tokens.tolist(), batch.targets.tolist(), batch.loss_mask.tolist()):
        keys, values = tokens[0:2 * n:2], tokens[1:2 * n:2]
        assert len(set(keys)) == n and all(k < vocab_size // 2 <= v < vocab_size for k, v in zip(keys, values))
        table = dict(zip(keys, values))
        assert mask == [False] * (2 * n) + [True] * (length - 2 * n)
        assert all(targets[t] == table[tokens[t]] for t in range(2 * n, length))
    accuracy = task.metrics(lm_oracle(batch, task.vocab_size), batch)["accuracy"]
    assert nan_outside(accuracy, batch.loss_mask) and (accuracy[batch.loss_mask] == 1).all()


# ------------------------------------------------------------------ passkey

@FEW
@given(num_digits=st.integers(1, 7), data=st.data(), seed=SEEDS)
def test_passkey_answer_is_the_needle(num_digits, data, seed):
    task = make_task("passkey", num_digits=num_digits)
    length = data.draw(st.integers(2 * num_digits + 1, 300))
    batch = task.sample(4, length, gen(seed))
    k = num_digits
    for tokens, targets, mask, pos in zip(batch.tokens.tolist(), batch.targets.tolist(),
                                          batch.loss_mask.tolist(), batch.extra["needle_pos"].tolist()):
        assert tokens.count(task.needle) == tokens.count(task.query) == 1 and tokens.index(task.needle) == pos
        needle = tokens[pos + 1:pos + 1 + k]
        assert pos + k < length - k and all(d < 10 for d in needle)
        assert targets[length - k:] == needle and tokens[length - k:] == [task.query] + needle[:-1]
        assert mask == [False] * (length - k) + [True] * k
        filler = tokens[:pos] + tokens[pos + 1 + k:length - k]
        assert all(12 <= t < task.vocab_size for t in filler)
    accuracy = task.metrics(lm_oracle(batch, task.vocab_size), batch)["accuracy"]
    assert nan_outside(accuracy, batch.loss_mask) and (accuracy[batch.loss_mask] == 1).all()
