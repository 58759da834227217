"""lengthgen attention inside Hugging Face models (`lengthgen.hf`), on tiny random Llama and Qwen3 models.

Offline: models are built from configs, never downloaded.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="lengthgen.hf needs transformers (pip install lengthgen[hf])")

import lengthgen.hf as lhf  # noqa: E402
from lengthgen.attention import Attention, AttentionSpec, attend  # noqa: E402
from lengthgen.attention import functional as fn  # noqa: E402
from lengthgen.attention import mods  # noqa: E402
from lengthgen.hf.model import CACHE_FIELD  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
MODELS = ["llama", "qwen3"]
VARIANTS = ["l2", "ssmax", "sqrt_log_n", "scale_invariant", "alibi", "log_bias", "avnorm", "avnorm_rms", "gated"]
# Every parameterized knob at once (and the global multiplier shared across layers).
FULL = AttentionSpec(softmax_p=2.0, query_scaling="log_n", learnable_scaling="global", distance="alibi",
                     out_norm="head_layer", out_norm_affine=True, gate="head", gate_act="2sigmoid")
EXTRA = {"full": FULL, "window": AttentionSpec(window=3, query_scaling="log_n")}


def variant_spec(name: str) -> AttentionSpec:
    return EXTRA[name] if name in EXTRA else AttentionSpec.preset(name)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: threads only add overhead (and contend with parallel test workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(kind: str, seed: int = 0):
    """A 2-layer GQA model (4 query heads, 2 kv heads, head_dim 16) with weights large enough to matter."""
    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, initializer_range=0.1, attn_implementation="eager")
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    return model.eval()


def quiet_retrofit(model, spec, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lhf.retrofit(model, spec, **kw)


def randomize_retrofit(model, seed=1):
    """Move the retrofit parameters off their init so that they are tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lhf.lengthgen_parameters(model).items():
            scale = 0.3 if name.endswith("gate.weight") else 0.2
            p.add_(torch.randn(p.shape, generator=g) * scale)


def batch(length=16, pad=5, seed=3):
    """Row 0 left-padded by ``pad``, row 1 full; 1 = token."""
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, :pad] = 0
    return ids, mask


def logits(model, ids, mask=None, impl=None):
    if impl is not None:
        model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# ---------------------------------------------------------------------------------------------------
# baseline = the model's own attention


@pytest.mark.parametrize("kind", MODELS)
def test_baseline_reproduces_eager_and_sdpa(kind):
    model = tiny(kind)
    ids, left = batch()
    mixed = left.clone()
    mixed[1, -4:] = 0                                     # row 1 right-padded
    masks = {"none": None, "left": left, "left+right": mixed}
    want = {(impl, m): logits(model, ids, masks[m], impl) for impl in ("eager", "sdpa") for m in masks}
    lhf.retrofit(model, "baseline")
    assert model.config._attn_implementation == "lengthgen"
    for m, mask in masks.items():
        got = logits(model, ids, mask)
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        for impl in ("eager", "sdpa"):
            torch.testing.assert_close(got[real], want[impl, m][real], **TOL, msg=f"{impl} / {m} mask")


@pytest.mark.parametrize("kind", MODELS)
def test_baseline_generate_with_kv_cache_matches_eager(kind):
    model = tiny(kind)
    ids, mask = batch(length=10, pad=3)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("eager")
    want = model.generate(ids, **kw)
    lhf.retrofit(model, "baseline")
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------
# each variant = lengthgen's own computation


def reference(attn, spec, q, k, v, x, doc_ids):
    """attend(dense) + out_norm + affine + gate on the tensors HF handed to the attention function."""
    state = getattr(attn, "lengthgen", None)
    mult = state.multiplier if state is not None else None
    run = spec.replace(base_scale=attn.scaling, doc_masking=True)
    y = attend(q, k, v, run, doc_ids=doc_ids, multipliers=mult, backend="dense")
    y = fn.out_norm(y, spec.out_norm, spec.out_norm_eps)
    b, h, length, d = y.shape
    y = y.transpose(1, 2).reshape(b, length, h * d)
    if state is not None and state.out_norm.weight is not None:
        y = y * state.out_norm.weight + (state.out_norm.bias if state.out_norm.bias is not None else 0)
    if state is not None and state.gate.weight is not None:
        gate = torch.sigmoid(x @ state.gate.weight.T) * (2 if spec.gate_act == "2sigmoid" else 1)
        y = y * (gate.repeat_interleave(d, -1) if spec.gate == "head" else gate)
    return y.view(b, length, h, d)


@pytest.mark.parametrize("variant", VARIANTS + list(EXTRA))
@pytest.mark.parametrize("kind", MODELS)
def test_variant_equals_attend_on_the_models_qkv(kind, variant):
    spec = variant_spec(variant)
    model = quiet_retrofit(tiny(kind), spec)
    randomize_retrofit(model)
    attn = lhf.attention_modules(model)[1][1]             # the second layer: its input depends on the first
    seen = {}
    attn.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True)
    attn.lengthgen_record = record = {}
    ids, mask = batch()
    logits(model, ids, mask)
    assert record["q"].shape == (2, 4, 16, 16) and record["k"].shape == (2, 2, 16, 16)   # GQA, after RoPE
    assert record["dense_mask"] is None                                                   # padding -> documents
    assert torch.equal(mods.document_bounds(record["doc_ids"])[0], mods.document_bounds(mask)[0])
    want = reference(attn, spec, record["q"], record["k"], record["v"], seen["x"], doc_ids=mask)
    torch.testing.assert_close(record["out"], want, **TOL)


@pytest.mark.parametrize("variant", ["baseline"] + VARIANTS + list(EXTRA))
def test_llama_attention_equals_lengthgen_attention_layer(variant):
    """Llama's attention with the lengthgen function = lengthgen's `Attention` layer with the same weights (RoPE
    layouts and frequencies agree), o_proj included."""
    spec = variant_spec(variant)
    model = quiet_retrofit(tiny("llama"), spec)
    randomize_retrofit(model)
    attn = lhf.attention_modules(model)[0][1]
    io = {}
    attn.register_forward_pre_hook(lambda m, a, kw: io.update(x=kw["hidden_states"]), with_kwargs=True)
    attn.register_forward_hook(lambda m, a, out: io.update(out=out[0]))
    ids, _ = batch()
    logits(model, ids)
    own = Attention(64, 4, spec.replace(kv_heads=2, position="rope", qk_norm="none"), head_dim=16, backend="dense")
    state = getattr(attn, "lengthgen", None)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(own, name).weight.copy_(getattr(attn, name).weight)
        if state is not None:
            own.out_norm.load_state_dict(state.out_norm.state_dict())
            own.gate.load_state_dict(state.gate.state_dict())
            if own.scaling.multiplier is not None:
                own.scaling.multiplier.copy_(state.multiplier)
        torch.testing.assert_close(own(io["x"]), io["out"], **TOL)


@pytest.mark.parametrize("kind", MODELS)
def test_padding_packing_and_kv_cache_are_invisible(kind):
    """Padded rows, packed documents and cached decoding give what each sequence gives alone: n_i counts real
    tokens of the same document only, and distances are relative."""
    model = quiet_retrofit(tiny(kind), FULL)
    randomize_retrofit(model)
    ids, mask = batch(length=14, pad=5)
    alone = logits(model, ids[:1, 5:])
    torch.testing.assert_close(logits(model, ids, mask)[0, 5:], alone[0], **TOL)
    # two documents packed in one row, told apart by position_ids (HF builds a block-causal mask)
    packed = ids[1:]
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with torch.no_grad():
        got = model(input_ids=packed, position_ids=pos, use_cache=False).logits[0]
    torch.testing.assert_close(got[:6], logits(model, packed[:, :6])[0], **TOL)
    torch.testing.assert_close(got[6:], logits(model, packed[:, 6:])[0], **TOL)
    # KV-cache decoding with left padding = recomputing everything
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("kind", MODELS)
def test_a_right_padded_batch_prefilled_in_chunks_equals_one_forward(kind):
    """A chunk whose last tokens are padding in every row (a right-padded batch after a cached chunk) raised
    'queries see later keys': its unseen trailing keys were dropped as if they were an unfilled static cache."""
    model = quiet_retrofit(tiny(kind), FULL)
    randomize_retrofit(model)
    ids, _ = batch(length=12)
    mask = torch.ones_like(ids)
    mask[0, 8:], mask[1, 10:] = 0, 0
    with torch.no_grad():
        first = model(input_ids=ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        rest = model(input_ids=ids[:, 6:], attention_mask=mask, **{CACHE_FIELD: first[CACHE_FIELD]})
    chunked = torch.cat([first.logits, rest.logits], dim=1)
    torch.testing.assert_close(chunked[mask.bool()], logits(model, ids, mask)[mask.bool()], **TOL)


def test_arbitrary_masks_run_as_explicit_masks_and_noncausal_masks_raise():
    model = tiny("llama")
    ids, _ = batch(length=12)
    allowed = torch.ones(12, 12).tril().bool()
    allowed[7:, 2:4] = False                              # not a padding / document pattern
    allowed = allowed[None, None].expand(2, 1, 12, 12)
    want = logits(model, ids, allowed, impl="sdpa")
    lhf.retrofit(model, "baseline")
    torch.testing.assert_close(logits(model, ids, allowed), want, **TOL)
    with pytest.raises(ValueError, match="later keys"):
        logits(model, ids, torch.ones(2, 1, 12, 12, dtype=torch.bool))


def test_sliding_window_model_matches_eager():
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, sliding_window=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        initializer_range=0.1, attn_implementation="eager")
    model = transformers.MistralForCausalLM(config).eval()
    ids, mask = batch(length=12, pad=3)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    want, want_tokens = logits(model, ids, mask), model.generate(ids, **kw)
    lhf.retrofit(model, "baseline")
    torch.testing.assert_close(logits(model, ids, mask)[mask.bool()], want[mask.bool()], **TOL)
    assert torch.equal(model.generate(ids, **kw), want_tokens)


def test_plan_mask_turns_padding_into_documents():
    lq = lk = 6
    allowed = torch.ones(lq, lk).tril().bool()[None, None].repeat(2, 1, 1, 1)
    allowed[0, :, :, :2] = False                          # row 0: two padding keys (left padding)
    plan = lhf.plan_mask(allowed, lq, lk, window=None)
    assert not plan.explicit and plan.doc_ids.tolist() == [[0, 0, 1, 1, 1, 1], [0] * 6]
    assert lhf.plan_mask(allowed[1:], lq, lk, window=None).doc_ids is None     # plain causal: no documents
    decode = allowed[:, :, -1:]                           # one cached-decoding query
    assert lhf.plan_mask(decode, 1, lk, window=None).doc_ids.tolist() == [[0, 0, 1, 1, 1, 1], [0] * 6]


def test_a_mask_is_planned_once_per_forward(monkeypatch):
    """Every layer of a forward gets the same mask object, which keeps its plan: no global cache."""
    calls = []
    plan = lhf.masks.plan_mask
    monkeypatch.setattr(lhf.masks, "plan_mask", lambda *a, **kw: calls.append(1) or plan(*a, **kw))
    model = quiet_retrofit(tiny("llama"), "l2")
    ids, mask = batch()
    first = logits(model, ids, mask)
    assert len(calls) == 1                                # two layers, one plan
    torch.testing.assert_close(logits(model, ids, mask), first, rtol=0, atol=0)
    assert len(calls) == 2                                # a new forward builds a new mask
    explicit = torch.ones(16, 16).tril().bool()[None, None].expand(2, 1, 16, 16).clone()
    logits(model, ids, explicit)
    logits(model, ids, explicit)
    assert len(calls) == 3                                # the same mask object: planned once
    explicit[:, :, 5:, :2] = False                        # changed in place: planned again
    logits(model, ids, explicit)
    assert len(calls) == 4


# ---------------------------------------------------------------------------------------------------
# retrofit, finetuning, save / reload


def test_retrofit_gives_the_model_its_own_config():
    """Two models built from one config object: retrofitting one changes neither the other's config, nor its
    attention, nor what it saves."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      initializer_range=0.1, attn_implementation="eager")
    torch.manual_seed(0)
    a, b = transformers.LlamaForCausalLM(config).eval(), transformers.LlamaForCausalLM(config).eval()
    b.load_state_dict(a.state_dict())
    ids, mask = batch()
    want = logits(b, ids, mask)
    quiet_retrofit(a, "l2")
    assert a.config is not config and a.config.lengthgen_spec == AttentionSpec.preset("l2").to_dict()
    assert all(m.config is a.config for _, m in lhf.attention_modules(a))
    assert getattr(b.config, "lengthgen_spec", None) is None and b.config._attn_implementation == "eager"
    assert all(m.config is config for _, m in lhf.attention_modules(b))
    torch.testing.assert_close(logits(b, ids, mask), want, rtol=0, atol=0)
    assert not torch.allclose(logits(a, ids, mask)[mask.bool()], want[mask.bool()], atol=1e-3)
    assert "lengthgen_spec" not in b.config.to_dict()


def test_register_is_idempotent_and_reload_changes_no_transformers_class(tmp_path):
    lhf.register()
    lhf.register()
    assert transformers.AttentionInterface()["lengthgen"] is lhf.lengthgen_attention_forward
    assert transformers.AutoConfig.for_model("lengthgen").model_type == "lengthgen"
    model = quiet_retrofit(tiny("llama"), FULL)
    randomize_retrofit(model)
    model.save_pretrained(tmp_path)
    cls = transformers.LlamaForCausalLM
    before = dict(vars(cls))
    reports = []
    handler = logging.Handler()
    handler.emit = reports.append
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    try:
        again = lhf.from_pretrained(tmp_path)
    finally:
        logger.removeHandler(handler)
    assert dict(vars(cls)) == before and type(again) is cls
    assert not any("lengthgen" in r.getMessage() for r in reports)   # the load report has nothing to say


@pytest.mark.parametrize("kind", MODELS)
def test_retrofit_2sigmoid_gate_is_identity_and_finetunes(kind):
    model = tiny(kind)
    ids, mask = batch()
    want = logits(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # an identity retrofit warns about nothing
        lhf.retrofit(model, "gated")
    torch.testing.assert_close(logits(model, ids, mask)[mask.bool()], want[mask.bool()], **TOL)
    params = lhf.lengthgen_parameters(model)
    assert len(params) == 2 and all(n.endswith("lengthgen.gate.weight") for n in params)
    # a tiny repetitive corpus: 20 AdamW steps lower the loss and move the gates
    corpus = torch.arange(8).repeat(2, 3) + 10
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(20):
        loss = model(input_ids=corpus, labels=corpus).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.abs().sum() > 0 for p in params.values())


def test_retrofit_warns_when_outputs_change():
    with pytest.warns(UserWarning, match="sigmoid"):
        lhf.retrofit(tiny("llama"), AttentionSpec(gate="elementwise", gate_act="sigmoid"))
    with pytest.warns(UserWarning, match="out_norm"):
        lhf.retrofit(tiny("llama"), "avnorm")
    with pytest.warns(UserWarning, match="position='nope' is not applied"):
        lhf.retrofit(tiny("llama"), "alibi")
    notes = lhf.retrofit_notes("sqrt_log_n")
    assert any("qk_norm" in n for n in notes) and any("query_scaling" in n for n in notes)
    assert lhf.retrofit_notes(AttentionSpec(query_scaling="log_n")) == [
        "query_scaling='log_n' multiplies the logits by a factor of n, the keys the query sees (not 1 at init)"]
    # every position field is the model's own: seed 000's truncated RoPE is not applied either, and says so
    assert lhf.retrofit_notes(AttentionSpec(rope_min_freq=1 / 1024)) == [
        "rope_min_freq=0.0009765625 is not applied on HF models (the model applies its own RoPE)"]


def test_retrofit_refuses_an_unknown_backend_and_leaves_the_model_alone():
    """A typo in ``backend`` was accepted and only failed at the first forward, with the model already switched to
    lengthgen attention."""
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"^retrofit: unknown attention backend 'flash'; choose one of auto, dense"):
        lhf.retrofit(model, "l2", backend="flash")
    assert model.config._attn_implementation == "eager" and not hasattr(model.config, "lengthgen_spec")


@pytest.mark.parametrize("kind", MODELS)
def test_save_and_reload_keep_the_retrofit(kind, tmp_path):
    model = quiet_retrofit(tiny(kind), FULL)
    randomize_retrofit(model)
    ids, mask = batch()
    want = logits(model, ids, mask)
    model.save_pretrained(tmp_path)
    again = lhf.from_pretrained(tmp_path)
    assert again.config._attn_implementation == "lengthgen"
    assert lhf.module_spec(lhf.attention_modules(again)[1][1]) == FULL
    a, b = (lhf.attention_modules(again)[i][1].lengthgen for i in (0, 1))
    assert b.multiplier is a.scaling.multiplier                          # the global multiplier stays shared
    torch.testing.assert_close(logits(again.eval(), ids, mask), want, **TOL)
    local = lhf.load_local_model(tmp_path)
    assert not local.training
    torch.testing.assert_close(logits(local, ids, mask), want, **TOL)


def test_a_global_multiplier_replaced_by_load_state_dict_assign_reaches_every_layer():
    """The other layers held the first layer's global multiplier Parameter itself: after
    ``load_state_dict(..., assign=True)`` replaced it, they silently ran the old value."""
    model, copied = quiet_retrofit(tiny("llama"), FULL), quiet_retrofit(tiny("llama"), FULL)
    state = {name: t + 0.5 if name.endswith("multiplier") else t for name, t in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    copied.load_state_dict(state)
    first, second = (m.lengthgen for _, m in lhf.attention_modules(model))
    assert second.multiplier is first.scaling.multiplier
    ids, mask = batch()
    torch.testing.assert_close(logits(model, ids, mask), logits(copied, ids, mask), rtol=0, atol=0)


def test_plain_transformers_load_of_a_retrofit_raises_instead_of_running_the_base_model(tmp_path, monkeypatch):
    """A saved retrofit read by transformers' own ``from_pretrained`` (which drops the retrofit parameters and
    hooks) never runs as the base model: with lengthgen.hf imported its attention raises naming the loader;
    without it, transformers refuses the folder's ``attn_implementation="lengthgen"``. Re-saving what
    `lhf.from_pretrained` loaded keeps that guard."""
    spec = AttentionSpec(softmax_p=2.0)                   # no parameters: the config alone could run it
    quiet_retrofit(tiny("llama"), spec).save_pretrained(tmp_path / "saved")
    lhf.from_pretrained(tmp_path / "saved").save_pretrained(tmp_path / "again")
    ids, _ = batch()
    for folder in ("saved", "again"):
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        with pytest.raises(RuntimeError, match=r"lengthgen\.hf\.from_pretrained"):
            logits(plain, ids)
    monkeypatch.delitem(transformers.AttentionInterface._global_mapping, "lengthgen")   # a process without lengthgen
    with pytest.raises(ValueError, match='attn_implementation="lengthgen"'):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")


def test_a_truncated_weight_file_of_a_saved_retrofit_or_an_export_names_the_file(tmp_path):
    """`lhf.from_pretrained` of a folder whose model.safetensors was cut short raised safetensors' SafetensorError,
    which names no file; now a `CheckpointError` naming it (one line in the CLI), for a saved retrofit (read by
    lengthgen) and an exported run (read by transformers)."""
    from lengthgen.train import train
    from lengthgen.train.checkpoint import CheckpointError
    from lengthgen.train.config import RunConfig

    quiet_retrofit(tiny("llama"), AttentionSpec(softmax_p=2.0)).save_pretrained(tmp_path / "retrofit")
    cfg = RunConfig.from_dict({"model": {"dim": 16, "layers": 1, "heads": 2}, "train": {"steps": 1, "batch_size": 2},
                               "data": {"task": "dyck", "length": 16}})
    train(cfg, tmp_path / "run", progress=False)
    lhf.export_run(tmp_path / "run", tmp_path / "export")
    for folder in ("retrofit", "export"):
        weights = tmp_path / folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:2000])
        with pytest.raises(CheckpointError, match=f"^{weights} is unreadable \\(SafetensorError: "):
            lhf.from_pretrained(tmp_path / folder)


def test_token_losses_and_load_local_model(tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path / "plain")
    local = lhf.load_local_model(tmp_path / "plain")
    ids, mask = batch()
    full = logits(local, ids, mask)[:, :-1]
    want = torch.nn.functional.cross_entropy(full.transpose(1, 2), ids[:, 1:], reduction="none")
    got = lhf.token_losses(local, ids, mask, max_logits=300)                 # several vocabulary chunks
    assert got.shape == (2, 15) and torch.isnan(got[0, :4]).all() and not torch.isnan(got[0, 4:]).any()
    torch.testing.assert_close(got[mask[:, 1:].bool()], want[mask[:, 1:].bool()], **TOL)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        lhf.load_local_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        lhf.load_local_model(tmp_path / "empty")


def test_missing_transformers_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'lengthgen\[hf\]'"):
        lhf.retrofit(torch.nn.Linear(2, 2), "baseline")


def test_transformers_older_than_the_tested_minimum_is_refused(monkeypatch):
    """transformers 5.0-5.3 ran a saved retrofit loaded with its own from_pretrained as the plain base model
    (test_plain_transformers_load_of_a_retrofit_raises_instead_of_running_the_base_model failed on 5.3.0)."""
    import importlib

    transformers = importlib.import_module("transformers")   # the module now in sys.modules: a from_pretrained
    monkeypatch.setattr(transformers, "__version__", "5.3.0")    # of 5.24 can replace the one imported above
    with pytest.raises(ImportError, match=r"needs transformers >= 5.4 \(installed: 5.3.0\): pip install -U"):
        lhf.retrofit(torch.nn.Linear(2, 2), "baseline")
    monkeypatch.setattr(transformers, "__version__", "5.4.0")
    assert lhf.registry.require_transformers() is transformers


def test_plan_mask_makes_no_tensor_wider_than_the_mask_in_bytes():
    """plan_mask found each row's last visible key through an int64 (B, Lq, Lk) table, eight times the boolean
    mask: planning a padded 8192-token mask took 451 MiB at its peak, 200 MiB without it (ru_maxrss)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.most = max(Largest.most, t.numel() * t.element_size())
            return out

    lq = lk = 64
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    allowed[0, 0, :, :3] = False           # left padding: row 0 sees from key 3
    allowed[0, 0, :3] = False
    with Largest():
        plan = lhf.plan_mask(allowed, lq, lk, window=None)
    assert plan.doc_ids is not None and not plan.explicit
    assert Largest.most <= allowed.numel()
