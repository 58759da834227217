"""Every preset in configs/ and every CPU analog in configs/cpu/ loads as is, documents itself, and trains 2 steps
+ evaluates by position on CPU with tiny overrides (the GPU-sized ones included, at their own depth); every
[compare] experiment plans its runs, and seed 000's whole protocol runs tiny. A CPU analog has 3 seeds or more,
evaluates to 16x its training length or more, and names in its header every key in which it differs from its
GPU preset."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from lengthgen.config import differences
from lengthgen.eval import Comparison, RunEval
from lengthgen.experiments.compare import base_config, plan, run_compare
from lengthgen.train import train
from lengthgen.train.config import load_config

ROOT = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(ROOT.glob("*.toml"))
ANALOGS = sorted((ROOT / "cpu").glob("*.toml"))
SEEDS = {"seed000_avnorm", "seed001_counting", "seed003_set_complement", "seed003_max_retrieval", "seed003_dyck",
         "seed003_tomita", "seed004_logit_scaling"}

TINY = ["model.head_dim=8", "model.heads=2", "model.dim=16", "train.steps=2", "train.batch_size=2",
        "train.tokens_per_step=none", "train.grad_accum=1", "train.stages=[]", "train.warmup_steps=0",
        "train.eval_every=0", "train.checkpoint_every=0", "train.eval_batches=1", "train.eval_batch_size=2",
        "train.compile=false", "train.device=cpu", "train.threads=1", "data.length=16", "train.eval_lengths=[16, 32]"]


def tiny(path: Path, *extra: str) -> list[str]:
    text = ["data.text.max_documents=24"] if load_config(path).data.kind == "text" else []
    return TINY + text + list(extra)


def test_presets_exist():
    names = {p.stem for p in CONFIGS}
    assert SEEDS | {"stdlib_small", "counting", "mqar"} <= names


def label(path: Path) -> str:
    return path.stem if path.parent == ROOT else f"{path.parent.name}/{path.stem}"


@pytest.mark.parametrize("path", CONFIGS + ANALOGS, ids=label)
def test_preset_loads_and_trains_tiny_on_cpu(path, tmp_path):
    text = path.read_text()
    assert text.startswith("#") and "lengthgen " in text.split("\nname")[0], \
        f"{path.name} needs a top comment saying what it reproduces and how to run it"
    if path.parent == ROOT and path.stem in SEEDS:
        assert "Remaining deviations" in text and "GPU time" in text, path.name
    full = load_config(path)                       # the preset itself is valid
    assert full.name == label(path).replace("/", "_")
    cfg = load_config(path, tiny(path))
    result = train(cfg, tmp_path / path.stem, progress=False)
    assert result.step == 2 and len(result.history) == 2
    rows = RunEval.load(tmp_path / path.stem / "eval.json").lengths
    assert [r.length for r in rows] == [16, 32]
    if result.config.model.head == "classify":    # per-sequence values (Tomita): no position buckets
        assert "loss" in rows[-1].at_length and not rows[-1].buckets
    else:
        assert "loss" in rows[-1].buckets and rows[-1].buckets["loss"][-1].hi == 32


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem in SEEDS] + ANALOGS, ids=label)
def test_seed_preset_compare_plans_every_run(path):
    """Every run of the preset's experiment has a valid config, and no two runs are the same experiment."""
    runs = plan(base_config(path))
    assert len(runs.runs) >= 3
    configs = {name: runs.config(name, 0, "pretrained" if runs.compare.pretrain_steps else None).to_json()
               for name in runs.runs}
    assert len(set(configs.values())) == len(configs)


@pytest.mark.parametrize("path", CONFIGS + ANALOGS, ids=label)
def test_compare_of_every_config_evaluates_at_lengths_its_data_has_and_warns_of_nothing(path):
    """``lengthgen compare --config PATH`` as shipped: its eval lengths (the [compare] section's, else the training
    length x 1 ... 16) are lengths its data can generate (mqar's vocabulary stops at 131: compare refused it), and
    no run of it has a setting it never reaches (seed 000's NoPE base inherits prope_fraction and rope_min_freq:
    turning positions off is that base's point, not a setting to warn about)."""
    from lengthgen.config import ConfigWarning
    from lengthgen.experiments.compare import _warn_unused, compare_config
    from lengthgen.experiments.eval_run import checked_lengths
    from lengthgen.train.setup import resolve

    cfg = base_config(path)
    resolved, source = resolve(cfg)
    lengths = checked_lengths(resolved, source, compare_config(cfg).eval_lengths, "compare.eval_lengths")
    with warnings.catch_warnings(record=True) as caught:                   # what run_compare checks first
        warnings.simplefilter("always")
        _warn_unused(resolved, plan(cfg), sorted({max(resolved.lengths()), *lengths}))
    assert [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)] == []


def test_seed000_protocol_runs_tiny(tmp_path):
    """One command: pretrain the pe and nope bases, finetune 4 variants from each, evaluate."""
    path = next(p for p in CONFIGS if p.stem == "seed000_avnorm")
    cfg = base_config(path, tiny(path, "compare.pretrain_steps=2", "compare.eval_lengths=[16, 32]",
                                 "compare.eval_tokens=64"))
    results = run_compare(cfg, tmp_path, progress=False, log=lambda _: None)
    assert list(results.variants) == [f"{b}/{v}" for b in ("pe", "nope")
                                      for v in ("l1", "groupnorm", "rmsnorm", "layernorm")]
    assert results.retrofit["pretrain_steps"] == 2 and Comparison.load(tmp_path / "results.json") == results
    nope = results.variants["nope/rmsnorm"][0].config["model"]["attention"]
    assert nope["position"] == "nope" and nope["out_norm"] == "head_rms" and nope["out_norm_eps"] == 1e-6


@pytest.mark.parametrize("path", [ROOT / "seed000_avnorm.toml", ROOT / "cpu" / "seed000_avnorm.toml"], ids=label)
def test_seed000_adamw_steps_on_odd_steps_as_the_seeds_distadam(path):
    """The seed's DistAdam (odd_step_only) steps on odd steps, on the two steps' summed gradients: no longer a
    deviation in the GPU preset's header, which says it."""
    assert load_config(path).train.adam_every == 2
    header = " ".join(line.lstrip("# ") for line in path.read_text().split("\nname")[0].splitlines())
    assert "AdamW updates every step" not in header
    if path.parent == ROOT:
        assert "DistAdam (lr 0.008, eps 1e-10, the multipliers and betas above) on odd steps only, on the two " \
            "steps' summed gradients (train.adam_every = 2;" in header


@pytest.mark.parametrize("path", [ROOT / "seed000_avnorm.toml", ROOT / "cpu" / "seed000_avnorm.toml"], ids=label)
def test_seed000_muon_update_lr_per_matrix_is_the_seeds(path):
    """The seed's NorMuon lr per matrix is muon_lr x max(1, rows / cols)^0.5 x lr_mul of its stored parameter: Q, K,
    V and O share one 3072 x 768 parameter (x2, each 768 x 768 block orthogonalized on its own), the MLP input is
    x2 and its output (stored 3072 x 768, lr_mul 2) x4; the gates go to AdamW (the seed's Adam: lr 0.008, betas
    0.9 / 0.99)."""
    from torch.optim._muon import _adjust_lr

    from lengthgen.model import GPT
    from lengthgen.train.optim import build_optimizers
    from lengthgen.train.setup import resolve

    cfg, _ = resolve(load_config(path, ["model.dim=48", "model.heads=2", "model.head_dim=24", "model.layers=11"]))
    model = GPT(cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = build_optimizers(model, cfg.train)[0]
    expected = {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "fc": 2, "proj": 4}
    seen = set()
    for group in muon.param_groups:
        for p in group["params"]:
            kind = names[id(p)].split(".")[-2]
            seen.add(kind)
            lr = _adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape)
            assert lr == pytest.approx(cfg.train.muon_lr * expected[kind]), names[id(p)]
    assert seen == set(expected)
    adamw = build_optimizers(model, cfg.train)[1]
    gates = {(names[id(p)].split(".")[-2], g["lr"], g["betas"]) for g in adamw.param_groups for p in g["params"]
             if names[id(p)].startswith("blocks.") and names[id(p)].endswith("gate.weight")}
    assert gates == {("gate", 0.008, (0.9, 0.99)), ("value_gate", 0.008, (0.9, 0.99))}


def header_text(path: Path) -> str:
    """A preset's top comment as one line."""
    return re.sub(r"\s*\n#\s*", " ", path.read_text().split("\nname")[0])


def test_seed000_finetunes_replay_the_pretrainings_first_batches():
    """The seed's finetunes restart its loader at the first shard, so they see again the data its pretraining
    began with; a finetune here draws the batches of the pretraining's first steps (the header says so)."""
    import torch

    from lengthgen.data.config import step_generator
    from lengthgen.train.setup import resolve

    path = ROOT / "seed000_avnorm.toml"
    assert "Both finetune on the data their pretraining started with" in header_text(path)
    runs = plan(base_config(path, ["data.text.max_documents=24", "train.tokens_per_step=4096"]))
    pretrain, finetune = runs.pretrain_config("pe", 0), runs.config("pe/groupnorm", 0, "pretrained")
    (_, source), (_, again) = resolve(pretrain), resolve(finetune)
    for step in (0, 7):
        rows, length = pretrain.batch_size_at(step), pretrain.length_at(step)
        assert (finetune.batch_size_at(step), finetune.length_at(step)) == (rows, length)
        first = source.sample(rows, length, step_generator(pretrain.train.seed, step))
        assert torch.equal(first.tokens, again.sample(rows, length, step_generator(finetune.train.seed, step)).tokens)


def test_seed000_header_lists_the_posts_other_figures():
    """The seed's plot.py draws the from-scratch figure with YaRN's attention scale and with --no_yarn_scale (a fixed
    1/sqrt(head_dim)), and the retrofit figure from sliding-window runs: the header lists both, and its --set gives
    the fixed scale."""
    from lengthgen.attention import functional as fn

    path = ROOT / "seed000_avnorm.toml"
    listed = header_text(path).split("Remaining deviations")[1]
    found = re.search(r"--no_yarn_scale \(a fixed 1/sqrt\(128\); --set (model\.attention\.base_scale=none)", listed)
    assert found and "plots, per the seed's plot.py, runs with sliding-window attention" in listed
    assert load_config(path).model.attention.base_scale == 0.1
    cfg = load_config(path, [found.group(1)]).model
    assert cfg.resolved_head_dim == 128 and fn.base_scale(cfg.attention, 128) == pytest.approx(128 ** -0.5)


def test_seed001_header_names_the_kernels_lengthgen_runs_on_cuda():
    """On CUDA `auto` runs p = 1 on SDPA and p != 1 on the Triton p-softmax kernel (full float32 dot products for
    float32), where the seed runs its one Triton kernel (TF32 dot products) for every p: the header says which."""
    import types

    import torch

    from lengthgen.attention.backends import choose

    pytest.importorskip("triton")
    path = ROOT / "seed001_counting.toml"
    header = header_text(path)
    assert "SDPA for p = 1, its Triton p-softmax kernel for p != 1" in header and "FlexAttention" not in header
    cfg = base_config(path)
    runs = plan(cfg)
    length = max(cfg.lengths())
    q = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"), dtype=torch.float32,
                              shape=(cfg.batch_size_at(cfg.train.steps - 1), cfg.model.heads, length,
                                     cfg.model.dim // cfg.model.heads))
    picked = {name: choose(runs.config(name, 0).model.attention, q, length, True) for name in runs.runs}
    assert picked == {"p1": "sdpa", "p2": "triton", "p0.5": "triton"}


def test_seed001_header_says_its_figure_plots_the_mse_and_how_to_headline_it():
    """The seed's plot.py draws val_acc_P, the MSE prefix mean, not the L1 loss it trains on: the header says so
    and that --metric sq_error makes it the headline, which the counting source accepts (lower is better); the
    preset's headline stays abs_error, the loss trained on; both have a chance level."""
    from lengthgen.experiments.compare import check_metric, compare_config
    from lengthgen.train.setup import resolve

    path = ROOT / "seed001_counting.toml"
    header = header_text(path)
    assert "the MSE prefix mean (its val_acc_P" in header and "(--metric sq_error makes the MSE the headline)" in header
    cfg = base_config(path)
    _, source = resolve(cfg)
    assert compare_config(cfg).metric is None and source.metric == "abs_error"
    assert check_metric(source, "sq_error") == ("sq_error", False)
    assert source.chance("abs_error", 8) is not None and source.chance("sq_error", 8) is not None


@pytest.mark.parametrize("name", ["seed003_dyck", "seed003_max_retrieval", "seed003_set_complement",
                                  "seed003_tomita"])
def test_seed003_header_states_every_training_constant_it_chooses(name):
    """Seed 003 is known through a summary that gives no training constants: the header names the value of each
    one the preset trains with (lengthgen's choices), AdamW's betas, eps, decayed parameters and init included,
    and BEMA's update interval (the authors' code defaults to 400 steps, the preset to 1)."""
    path = ROOT / f"{name}.toml"
    header = re.sub(r"\s*\n#\s*", " ", path.read_text().split("\nname")[0])
    cfg = load_config(path)
    tc, bema = cfg.train, cfg.train.bema

    def value(pattern: str) -> tuple[float, ...]:
        found = re.search(pattern, header)
        assert found, f"{path.name}'s header does not state {pattern!r}"
        return tuple(float(g) for g in found.groups())

    number = r"([\d.e-]+)"
    assert value(rf"learning rate \({number}\)") == (tc.lr,)
    assert value(rf"AdamW's betas \({number}, {number}\) and eps \({number}\)") == (*tc.betas, tc.eps)
    assert value(rf"weight decay \({number}, on 2-D weights only\)") == (tc.weight_decay,)
    assert tc.weight_decay_on == "matrices"
    assert value(rf"batch \({number} sequences\)") == (tc.batch_size,)
    assert value(rf"warmup \({number} steps\)") == (tc.warmup_steps,)
    assert value(rf"gradient clipping \(at {number}\)") == (tc.grad_clip,)
    assert cfg.model.init == "normal" and value(rf"init \(normal, std {number}\)") == (cfg.model.init_std,)
    assert tc.dtype == "auto" and "bf16 autocast on a GPU" in header
    assert value(rf"kappa {number}, eta {number}, rho {number}, gamma {number}, tau {number}") == (
        bema.kappa, bema.eta, bema.rho, bema.gamma, bema.tau)
    assert bema.update_every == 1 and "updated every step" in header


SEED003_NORMS_STATED = ["seed003_set_complement", "seed003_dyck", "seed003_max_retrieval", "seed003_tomita"]


@pytest.mark.parametrize("name", SEED003_NORMS_STATED)
def test_seed003_header_states_its_norm_eps_seeds_and_final_norm(name):
    """The header also names the RMSNorm eps and the seeds the preset trains with (the summary gives neither). The
    summary's architecture ('Architecture Onboarding': '... -> Residual Connection -> RMSNorm (Post/Peri) ->
    Unembedding Matrix') has no norm before the unembedding in the pre model: its variant (GPU preset and CPU
    analog) has none, post ends normalized, peri keeps a final norm after its residual."""
    from lengthgen.experiments.compare import compare_config

    path = ROOT / f"{name}.toml"
    header = re.sub(r"\s*\n#\s*", " ", path.read_text().split("\nname")[0])
    cfg = base_config(path)
    compare = compare_config(cfg)
    eps = re.search(r"learnable RMSNorm weights \(eps ([\d.e-]+)\)", header)
    assert cfg.model.norm_affine and eps and float(eps.group(1)) == cfg.model.norm_eps
    seeds = re.search(r"one seed per variant \((\d+)\)", header)
    assert seeds and compare.seeds == [int(seeds.group(1))]
    assert re.search(r"pre has no norm before the (unembedding|classifier) \(model.final_norm = false\)", header)
    for config in (path, ROOT / "cpu" / f"{name}.toml"):
        runs = plan(base_config(config))
        models = {run.split("/")[-1]: runs.config(run, 0).model for run in runs.runs}
        assert {v: (m.norm_placement, m.has_final_norm) for v, m in models.items()} == {
            "pre": ("pre", False), "post": ("post", False), "peri": ("peri", True)}, config


@pytest.mark.parametrize("name", ["seed003_dyck", "seed003_max_retrieval", "seed003_tomita"])
def test_seed003_model_larger_than_the_minimal_one_is_a_listed_deviation(name):
    """The summary's Method Summary gives one model for its four tasks (one attention-only layer, one head); a
    preset that trains another lists its shape among the remaining deviations."""
    path = ROOT / f"{name}.toml"
    listed = re.sub(r"\s*\n#\s*", " ", path.read_text().split("\nname")[0]).split("Remaining deviations")[1]
    m = load_config(path).model
    assert m.attention.position == "nope" and m.mlp_ratio > 0
    assert f"{m.layers} NoPE layers of width {m.dim}, {m.heads} heads and a GELU MLP ({m.mlp_ratio:g}x)" in listed
    assert m.mlp == "gelu"
    if load_config(path).data.task == "tomita":     # its classifier readout is lengthgen's choice too
        assert "the classifier: a linear head with 2 classes (cross-entropy) on the last position" in listed


def test_seed003_max_retrieval_header_lists_its_layout_and_metric():
    """The summary names maximum retrieval only and gives TVD and ROC AUC as its metrics: the task's layout and
    its accuracy metric are lengthgen's choices, listed among the deviations."""
    from lengthgen.train.setup import resolve

    path = ROOT / "seed003_max_retrieval.toml"
    listed = header_text(path).split("Remaining deviations")[1]
    _, source = resolve(load_config(path))
    assert source.metric == "accuracy" and "the metric (accuracy at the query) are lengthgen's choices" in listed


def test_seed004_header_lists_its_batch_steps_and_the_weights_muon_skips():
    """Seed 004 gives about 1B tokens, the context doubled halfway and 'Muon for 2D parameters' only: the header
    lists the batch, steps and evaluation tokens the preset chooses, and that the 2-D embedding and head go to
    AdamW (lengthgen's Muon takes the blocks' 2-D weights only)."""
    from lengthgen.experiments.compare import compare_config
    from lengthgen.model import GPT
    from lengthgen.train.optim import muon_param_names
    from lengthgen.train.setup import resolve

    path = ROOT / "seed004_logit_scaling.toml"
    listed = re.sub(r"\s*\n#\s*", " ", path.read_text().split("\nname")[0]).split("Remaining deviations")[1]
    cfg = load_config(path)
    tc = cfg.train
    first, second = (tc.tokens_per_step // length for _, length in tc.stages)
    assert (f"{tc.tokens_per_step} tokens per step ({first} sequences of {tc.stages[0][1]}, then {second} of "
            f"{tc.stages[1][1]}) for {tc.steps} steps") in listed
    assert f"{compare_config(cfg).eval_tokens} evaluation tokens per length" in listed
    small, _ = resolve(load_config(path, ["model.dim=16", "model.heads=2", "model.head_dim=8", "model.layers=1"]))
    names = muon_param_names(GPT(small.model))
    assert "embed.weight" not in names and "head.weight" not in names and tc.optimizer == "muon"
    assert "the embedding and the head are 2-D too but go to AdamW" in listed
    scaled = [v for v in compare_config(cfg).variants.values() if "query_scaling" in str(v)]
    assert scaled and cfg.model.attention.scaling_init == 1 and "parity across variants" in listed   # line 169


def test_seed003_set_complement_header_gives_the_ema_arm_of_its_bema_check():
    """The summary checks BEMA on this task against the raw and the EMA weights; the comparison evaluates raw and
    BEMA, and the header's --set turns BEMA into the plain EMA (no bias correction), which this checks."""
    import torch

    from lengthgen.train.bema import BEMA, bema_coefficients

    path = ROOT / "seed003_set_complement.toml"
    found = re.search(r"--set (train\.bema\.eta=[\d.]+) \(alpha = \(1 \+ t\)\^-[\d.]+ = 0\) reports it as "
                      r"name\+bema", header_text(path))
    assert found
    bema = load_config(path, [found.group(1)]).train.bema
    model = torch.nn.Linear(3, 2)
    tracker = BEMA(model, kappa=bema.kappa, eta=bema.eta, rho=bema.rho, gamma=bema.gamma, tau=bema.tau)
    tracker.update(0)                               # before the first step, as a run does
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        tracker.update(step)
        beta, _ = bema_coefficients(step, kappa=bema.kappa, eta=bema.eta, rho=bema.rho, gamma=bema.gamma,
                                    tau=bema.tau)
        for name, p in model.named_parameters():
            ema[name] = torch.lerp(ema[name], p.detach(), beta)
        for name, weight in tracker.weights().items():
            assert torch.allclose(weight, ema[name], atol=1e-6), (step, name)


def sqrt_log_n_variant(scaling: str = "global", attention: str = "", other: str = "") -> str:
    """A [compare.variants] table: the preset's sqrt_log_n variant with more attention fields and other keys."""
    fields = f'query_scaling = "sqrt_log_n", learnable_scaling = "{scaling}"{attention}'
    return f"{{model.attention = {{{fields}}}{other}}}"


#: seed 004's further experiments for which its header gives lengthgen keys -> the variants they make
SEED004_FURTHER = {
    'model.attention.learnable_scaling = "head", "layer" or "none"': [
        sqrt_log_n_variant(scaling) for scaling in ("head", "layer", "none")],
    'model.attention.position = "nope"': [sqrt_log_n_variant(attention=', position = "nope"')],
    'model.norm_placement = "peri"': [sqrt_log_n_variant(other=', model.norm_placement = "peri"')],
    'model.attention.out_norm = "head_rms"': [sqrt_log_n_variant(attention=', out_norm = "head_rms"')],
    'model.attention.qk_norm = "none", train.qk_clip = 100.0': [
        sqrt_log_n_variant(attention=', qk_norm = "none"', other=", train.qk_clip = 100.0")],
}


def test_seed004_header_lists_the_speedrun_pieces_and_further_experiments_left_out():
    """Seed 004's JAX port of the speedrun is not published: the header names the speedrun's pieces the model
    leaves out. The seed's further experiments are not variants; the keys the header gives for some make valid
    variants (here on the sqrt_log_n one), and the rest are named as having none."""
    from lengthgen.model import GPT

    path = ROOT / "seed004_logit_scaling.toml"
    listed = header_text(path).split("Remaining deviations")[1]
    assert ("none of the speedrun's value embeddings, U-net skips, soft-cap, residual and x0 lambdas, smear gate, "
            "multi-token prediction or sliding windows") in listed
    further = listed.split("the seed's further experiments are not variants here")[1]
    assert "Without a key: QKV-norm" in further and "Beta-logit scaling" in further
    small = ["model.dim=16", "model.heads=2", "model.head_dim=8", "model.layers=1", "model.vocab_size=64"]
    for text, tables in SEED004_FURTHER.items():
        assert text in further, text
        for table in tables:
            run = plan(base_config(path, [f"compare.variants.extra={table}", *small]), ["extra"]).config("extra", 0)
            assert run.model.attention.query_scaling == "sqrt_log_n" and run.model.attention.doc_masking, table
            GPT(run.model)


def test_every_seed_has_a_cpu_analog():
    assert {p.stem for p in ANALOGS} == SEEDS


@pytest.mark.parametrize("path", ANALOGS, ids=label)
def test_cpu_analog_is_its_seed_preset_made_smaller(path):
    """The issue's rules for a CPU analog: one command, 3 seeds or more, evaluated to 16x its training length or
    more, a measured wall time in its header, and every key in which it differs from the GPU preset named there
    (with why)."""
    header = path.read_text().split("\nname")[0]
    assert f"lengthgen compare --config configs/cpu/{path.name} --out runs/" in header
    assert "wall" in header and "What differs" in header, path.name
    cfg, gpu = load_config(path), load_config(ROOT / path.name)
    runs = plan(base_config(path))
    assert len(runs.compare.seeds) >= 3
    assert max(runs.compare.eval_lengths) >= 16 * max(cfg.lengths())
    differing = {key for key, _, _ in differences(gpu.to_dict(), cfg.to_dict())} - {"name"}
    parts = lambda key: [".".join(key.split(".")[:n]) for n in range(2, key.count(".") + 2)]  # noqa: E731
    named = lambda part: re.search(re.escape(part) + r"(?![\w.])", header)  # noqa: E731
    unnamed = sorted(key for key in differing if not any(named(part) for part in parts(key)))
    assert not unnamed, f"{path.name} differs from configs/{path.name} in keys its header does not name: {unnamed}"
