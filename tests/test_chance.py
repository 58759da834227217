"""Chance levels of the tasks: each equals what a simulated trivial predictor (one that knows the position, not
the tokens) scores on sampled batches, and the closed forms match plain-Python sums."""

from __future__ import annotations

import math

import pytest
import torch

from lengthgen.data.tasks import TASKS, make_task
from lengthgen.data.tasks.counting import binomial_median_error

LENGTH = 64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def at_length(values: torch.Tensor) -> tuple[float, float]:
    """Mean over positions [L/2, L) (NaN ignored) and its standard error over sequences."""
    per_sequence = values if values.dim() == 1 else values[:, values.shape[1] // 2:].nanmean(1)
    return float(per_sequence.mean()), float(per_sequence.std() / math.sqrt(len(per_sequence)))


def chance_at_length(task, metric: str, length: int = LENGTH) -> float:
    chance = task.chance(metric, length)
    return float(chance) if not torch.is_tensor(chance) else float(chance[length // 2:].nanmean())


def assert_near(simulated: tuple[float, float], chance: float, slack: float = 0.0) -> None:
    mean, stderr = simulated
    assert abs(mean - chance) <= 4 * stderr + slack + 1e-9, (mean, stderr, chance)


#: small vocabularies keep the simulations fast
SMALL = {"dyck": {}, "mqar": {"vocab_size": 48}, "passkey": {}, "max_retrieval": {"num_keys": 40, "num_values": 8},
         "set_complement": {}}


@pytest.mark.parametrize("name, metric", [("dyck", "legal_accuracy"), ("mqar", "accuracy"), ("passkey", "accuracy"),
                                          ("max_retrieval", "accuracy")])
def test_best_fixed_guess_per_position_scores_the_chance_accuracy(name, metric):
    """Fit, on one batch, the token that scores best at each position; score it on another batch."""
    task = make_task(name, **SMALL[name])
    fit, test = task.sample(2048, LENGTH, gen(0)), task.sample(2048, LENGTH, gen(1))

    def guess(tokens: torch.Tensor, batch) -> torch.Tensor:        # tokens (L,) -> metric (B, L)
        logits = torch.nn.functional.one_hot(tokens, task.vocab_size).float().expand(len(batch.tokens), -1, -1)
        return task.metrics(logits, batch)[metric]

    scores = torch.stack([guess(torch.full((LENGTH,), v), fit).nanmean(0) for v in range(task.vocab_size)])
    best = scores.nan_to_num(-1.0).argmax(0)                       # (L,)
    simulated = guess(best, test)
    chance = task.chance(metric, LENGTH)
    assert torch.equal(chance.isnan(), simulated[0].isnan())       # defined exactly where the metric is
    assert_near(at_length(simulated), chance_at_length(task, metric))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_next_token_frequencies_per_position_reach_the_chance_loss(name):
    """The position-only predictor: next-token frequencies at each position on one batch (add-1/2 smoothing),
    its cross-entropy on another at the scored positions."""
    task = make_task(name, **SMALL[name])
    fit, test = task.sample(8192, LENGTH, gen(0)), task.sample(4096, LENGTH, gen(1))
    counts = torch.zeros(LENGTH, task.vocab_size).index_put_(
        (torch.arange(LENGTH).expand_as(fit.targets)[fit.loss_mask], fit.targets[fit.loss_mask]),
        torch.tensor(1.0), accumulate=True)
    log_probs = (counts + 0.5).log() - (counts + 0.5).sum(-1, keepdim=True).log()          # (L, V)
    loss = -log_probs.gather(1, test.targets.T).T                                           # (B, L)
    loss = torch.where(test.loss_mask, loss, math.nan)
    assert torch.equal(task.chance("loss", LENGTH).isnan(), ~test.loss_mask[0])
    # smoothing costs at most about (V - 1) / (2 * samples per position) nats
    assert_near(at_length(loss), chance_at_length(task, "loss"), slack=task.vocab_size / 8192)


def test_set_complement_uniform_guess_has_tvd_p_over_n_exactly():
    task = make_task("set_complement", num_tokens=32)
    batch = task.sample(64, 32, gen(0))
    logits = torch.zeros(64, 32, task.vocab_size)
    logits[..., task.bos] = -math.inf                               # uniform over the 32 tokens
    torch.testing.assert_close(task.metrics(logits, batch)["tvd"].double(),
                               task.chance("tvd", 32).expand(64, -1), rtol=0, atol=1e-6)


def test_counting_median_of_the_count_per_position_has_the_chance_error():
    task = make_task("counting", vocab_size=4)
    fit, test = task.sample(4096, LENGTH, gen(0)), task.sample(4096, LENGTH, gen(1))
    median = fit.targets.median(0).values                           # the best position-only L1 guess
    errors = task.metrics(median.expand_as(test.targets), test)["abs_error"]
    assert_near(at_length(errors), chance_at_length(task, "abs_error"))
    assert torch.equal(task.chance("loss", LENGTH), task.chance("abs_error", LENGTH))   # the loss is L1
    assert task.chance("rel_error", LENGTH) is None


def test_counting_mean_of_the_count_per_position_has_the_chance_squared_error():
    """sq_error (seed 001's MSE, reported in every counting comparison) had no chance level."""
    task = make_task("counting", vocab_size=4)
    fit, test = task.sample(4096, LENGTH, gen(0)), task.sample(4096, LENGTH, gen(1))
    errors = task.metrics(fit.targets.mean(0).expand_as(test.targets), test)["sq_error"]
    assert_near(at_length(errors), chance_at_length(task, "sq_error"))
    torch.testing.assert_close(task.chance("sq_error", 3), torch.tensor([0, 3 / 16, 6 / 16], dtype=torch.float64))


@pytest.mark.parametrize("q", [0.5, 1 / 3, 1 / 32, 0.9])
def test_binomial_median_error_matches_the_python_sum(q):
    def exact(n: int) -> float:
        pmf = [math.comb(n, k) * q ** k * (1 - q) ** (n - k) for k in range(n + 1)]
        return min(sum(p * abs(k - c) for k, p in enumerate(pmf)) for c in range(n + 1))

    got = binomial_median_error(60, q)
    assert got.shape == (60,)
    assert max(abs(float(got[n]) - exact(n)) for n in range(60)) < 1e-12


def test_dyck_depth_law_matches_sampled_depths():
    task = make_task("dyck", num_types=2, max_depth=3)
    law = task.depth_law(40)
    torch.testing.assert_close(law.sum(1), torch.ones(40, dtype=torch.float64))
    legal = task.sample(20000, 40, gen(0)).extra["legal"]
    full = (~legal[..., 0]).double().mean(0)                        # no opener is legal at depth m
    empty = (~legal[..., 2:4].any(-1)).double().mean(0)             # no closer is legal at depth 0
    assert (full - law[:, -1]).abs().max() < 0.015 and (empty - law[:, 0]).abs().max() < 0.015
    # the walk is periodic: depth m only after an even number of brackets when m is even, odd when odd
    assert float(law[0::2, -1].max()) == 0.0 and float(law[1::2, -1].max()) > 0.2
    long = task.depth_law(5000)                                     # filled in by its period
    torch.testing.assert_close(long[4998:], long[4996:4998])
    torch.testing.assert_close(long[:40], law)


@pytest.mark.parametrize("num_types, max_depth", [(1, 3), (2, 4), (3, 2)])
def test_dyck_tvd_chance_is_the_best_fixed_distribution(num_types, max_depth):
    """By simulation alone: the best of a grid of fixed distributions (a / k on each opener, (1 - a) / k on each
    closer), picked per position on one batch, scores the closed form's chance level on another; no fixed
    distribution drawn from the whole simplex (BOS included) beats it."""
    task = make_task("dyck", num_types=num_types, max_depth=max_depth)
    k, vocab = num_types, task.vocab_size
    fit, test = task.sample(2048, LENGTH, gen(2)), task.sample(2048, LENGTH, gen(3))

    def tvd(q: torch.Tensor, batch) -> torch.Tensor:                 # q (L, V) -> tvd (B, L)
        return task.metrics(q.log().expand(len(batch.tokens), -1, -1), batch)["tvd"]

    def split(a: torch.Tensor) -> torch.Tensor:                      # a (L,) -> (L, V)
        q = torch.zeros(LENGTH, vocab)
        q[:, :k], q[:, k:2 * k] = a[:, None] / k, (1 - a[:, None]) / k
        return q

    grid = torch.linspace(0, 1, 21)
    fitted = torch.stack([tvd(split(torch.full((LENGTH,), float(a))), fit).mean(0) for a in grid])   # (21, L)
    best = grid[fitted.argmin(0)]
    assert_near(at_length(tvd(split(best), test)), chance_at_length(task, "tvd"))
    torch.manual_seed(0)
    simplex = torch.distributions.Dirichlet(torch.ones(vocab)).sample(torch.Size([30]))
    for q in simplex:
        mean, stderr = at_length(tvd(q.expand(LENGTH, -1), test))
        assert mean >= chance_at_length(task, "tvd") - 4 * stderr


def test_tomita_always_accept_is_at_chance():
    task = make_task("tomita")
    batch = task.sample(4096, 24, gen(0))
    accept = torch.tensor([0.0, 1.0]).expand(4096, -1)
    assert_near(at_length(task.metrics(accept, batch)["accuracy"]), task.chance("accuracy", 24))
    uniform_loss = torch.nn.functional.cross_entropy(torch.zeros(4096, 2), batch.targets)
    assert task.chance("loss", 24) == pytest.approx(float(uniform_loss))
    assert task.chance("score", 24) is None
    # a score that ignores the string ranks positives and negatives alike: ROC AUC 1/2
    values = task.metrics(accept, batch)
    assert task.batch_metrics(values, batch)["roc_auc"] == task.chance("roc_auc", 24) == 0.5


def test_every_task_states_the_chance_of_its_headline_and_loss():
    for name in TASKS:
        task = make_task(name)
        length = 32
        for metric in (task.metric, "loss"):
            chance = task.chance(metric, length)
            assert chance is not None, (name, metric)
            value = chance_at_length(task, metric, length)
            assert math.isfinite(value) and value >= 0, (name, metric, value)
