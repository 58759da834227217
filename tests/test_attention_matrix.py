"""The coverage matrix of the attention math: every `AttentionSpec` option on every CPU backend, through a float64
`torch.autograd.gradcheck` and against the float64 dense oracle in bfloat16 (values and gradients); every option of
the `Attention` layer likewise (on dense, and on every CPU backend with a backward for those that change what the
layer hands `attend`).

Each layer option's values also equal `explicit_layer`, the layer written from its formulas in plain torch, and
`test_every_knob_changes_its_cells` holds every field an option sets to changing what its cells compute.

The other cells are elsewhere: float64 / float32 values and gradients of every option on tiled, sdpa and cpu_flash
against dense in test_attention_backends.py (flex: values in test_flex.py; the Triton kernel under the interpreter in
test_triton.py), the layer's options on tiled against dense in test_attention_module.py, extreme logits and p values
in test_numerics.py. Here the shapes are tiny: GQA (2 query heads on 1 key/value head), fewer queries than keys,
several documents; the query-scaling multiplier per head, a scalar or the fixed scaling_init (`multiplier`). The
gradchecks run in fast mode (the numerical and analytical Jacobians along random directions: a gradient 1% off
fails), full-mode ones of chosen combinations are in test_attention_backends.py.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch
import torch.nn.functional as F
from test_attention_backends import OPTIONS, naive_attention
from test_attention_module import MODULE_OPTIONS

from lengthgen.attention import FIELDS, Attention, AttentionSpec, attend, backends
from lengthgen.attention import functional as fn
from lengthgen.config import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TRAINING = ("dense", "tiled", "sdpa", "cpu_flash")      # the CPU backends with a backward (flex has none on CPU)
DOCS = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2], [3, 3, 3, 3, 4, 4, 5, 5]])
BF16 = torch.finfo(torch.bfloat16).eps


def supported(backend: str, training: bool) -> list[str]:
    probe = torch.empty(1, 2, 4, 4)
    return [n for n in OPTIONS if backends.unsupported(backend, AttentionSpec(**OPTIONS[n]), probe, training) is None]


def cells(names: tuple[str, ...], training: bool) -> list:
    return [pytest.param(option, backend, id=f"{option}-{backend}") for backend in names
            for option in supported(backend, training)]


def run(backend: str, q, k, v, spec, docs, multipliers=None, mask=None):
    """`attend` on ``backend``; tiled with blocks of 3 x 2 and cpu_flash with query blocks of 3, so that several
    blocks, and windows, documents and masks across them, are exercised at these lengths."""
    if backend in ("tiled", "cpu_flash"):
        qs = fn.scale_queries(q, spec, k.shape[-2], docs, multipliers, mask)
        blocks = dict(q_block=3, k_block=2) if backend == "tiled" else dict(q_block=3)
        return backends.module(backend).attention(qs, k, v, spec, docs, mask=mask, **blocks)
    return attend(q, k, v, spec, doc_ids=docs, multipliers=multipliers, mask=mask, backend=backend)


def inputs(dtype=torch.float64, lq=6, lk=8, seed=0):
    """q (2, 2, lq, 4), k and v (2, 1, lk, 4) of ``dtype`` (drawn in float64, then rounded) and a (2,) multiplier."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, 4, generator=g, dtype=torch.float64).to(dtype)
               for h, n in ((2, lq), (1, lk), (1, lk)))
    return q, k, v, torch.tensor([0.7, 1.3], dtype=torch.float64)


#: the query-scaling multiplier each option's cells pass to `attend`: one per head (learnable_scaling head) by
#: default, a scalar tensor (global, layer) or none (the fixed scaling_init, a Python float) for these
SCALAR_MULTIPLIER, FIXED_MULTIPLIER = ("log_bn", "sqrt_log_n_abc"), ("log_n_s",)


def multiplier(option: str, per_head: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    """``per_head`` (from `inputs`), a scalar, or None, as `SCALAR_MULTIPLIER` and `FIXED_MULTIPLIER` say, in
    ``dtype``; None without query scaling."""
    if AttentionSpec(**OPTIONS[option]).query_scaling == "none" or option in FIXED_MULTIPLIER:
        return None
    return (per_head.new_tensor(0.8) if option in SCALAR_MULTIPLIER else per_head).to(dtype)


def test_the_options_use_every_choice():
    """A choice of an `AttentionSpec` field that no option uses (a new distance term or query scaling) fails here,
    until an entry of OPTIONS (what `attend` reads: every backend's cells) or MODULE_OPTIONS (the layer's) uses it;
    the cells below then run it. So does a field that no option sets (a new knob)."""
    core, layer = ({(f, v) for changes in options for f, v in changes.items()} for options in
                   (OPTIONS.values(), LAYER_OPTIONS.values()))
    missing = [f"{field}={choice!r}" for field, hint in typing.get_type_hints(AttentionSpec).items()
               if typing.get_origin(hint) is typing.Literal for choice in typing.get_args(hint)
               if choice != getattr(AttentionSpec(), field)
               and (field, choice) not in (core if field in ("query_scaling", "distance") else core | layer)]
    assert not missing, f"no option of the matrix uses {', '.join(missing)}"
    unset = [f for f in FIELDS if not any(f in changes for changes in (*OPTIONS.values(), *LAYER_OPTIONS.values()))]
    assert not unset, f"no option of the matrix sets {', '.join(unset)}"


def test_what_attend_reads_is_in_the_options_of_every_backend():
    """A field that changes what `attend` computes belongs in OPTIONS, whose cells run on every backend: set only by
    a layer option (a new knob of the distance terms, say) it would run on dense alone (the layer's options reach the
    other backends only with a learnable multiplier or GQA, `layer_cells`). q, k, v of the layer cells' shapes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, 8, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(3))
    core = {field for changes in OPTIONS.values() for field in changes}
    layer_only = [f"{option}.{field}" for option, changes in LAYER_OPTIONS.items() for field in set(changes) - core
                  if (off := knob_off(changes, field)) is not None and not unchanged(
                      attend(q, k, v, off, doc_ids=DOCS, backend="dense"),
                      attend(q, k, v, AttentionSpec(**changes), doc_ids=DOCS, backend="dense"))]
    assert not layer_only, f"read by attend but set only by a layer option: {', '.join(layer_only)}"


@pytest.mark.parametrize("option, backend", cells(TRAINING, training=True))
def test_gradcheck_every_option_on_every_backend(option, backend):
    """q, k, v and, with query scaling, the learnable multiplier s / r (per head or a scalar: `multiplier`)."""
    spec = AttentionSpec(**OPTIONS[option])
    q, k, v, mult = inputs()
    mult = multiplier(option, mult)
    args = [t.requires_grad_() for t in [q, k, v] + ([] if mult is None else [mult])]
    assert torch.autograd.gradcheck(lambda q, k, v, m=None: run(backend, q, k, v, spec, DOCS, m), args, fast_mode=True)


@pytest.mark.parametrize("option", supported("flex", training=False))
def test_flex_every_option_float64_values(option):
    """FlexAttention on CPU (forward only) equals the oracle to float64 precision for every option, query scaling
    and base_scale included (test_flex.py's cases call the backend with queries already scaled)."""
    spec = AttentionSpec(**OPTIONS[option])
    q, k, v, mult = inputs()
    mult = multiplier(option, mult)
    with torch.no_grad():
        torch.testing.assert_close(run("flex", q, k, v, spec, DOCS, mult), run("dense", q, k, v, spec, DOCS, mult),
                                   rtol=1e-10, atol=1e-10)


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor], floor: float = 0.0) -> list[float]:
    """max |got - want| over max |want| (or ``floor`` for a scalar, if larger), for each pair."""
    return [float((g.double() - w).abs().max() / max(float(w.abs().max()), floor if w.numel() == 1 else 0.0))
            for g, w in zip(got, want)]


@pytest.mark.parametrize("option, backend", cells((*TRAINING, "flex"), training=False))
def test_bfloat16_every_option_on_every_backend_against_float64(option, backend):
    """bfloat16 q, k, v (and multiplier) against the float64 oracle on the same rounded inputs: the output and
    gradients (flex: the output) within bfloat16's rounding of their size (the math runs in float32)."""
    spec = AttentionSpec(**OPTIONS[option])
    q, k, v, mult = inputs(torch.bfloat16)
    mult = multiplier(option, mult, torch.bfloat16)
    train = backend != "flex"
    ins = [t.requires_grad_(train) for t in (q, k, v)]
    ref = [t.detach().double().requires_grad_() for t in ins]
    with torch.set_grad_enabled(train):
        out = run(backend, *ins, spec, DOCS, mult)
    want = attend(*ref, spec, doc_ids=DOCS, multipliers=None if mult is None else mult.double(), backend="dense")
    assert out.dtype == torch.bfloat16
    got, wanted = [out], [want.detach()]
    if train:
        gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        got += torch.autograd.grad(out, ins, gout.to(out.dtype))
        wanted += torch.autograd.grad(want, ref, gout)
    errors = relative_errors(got, wanted)
    assert max(errors) <= BF16, errors


def explicit_mask() -> torch.Tensor:
    """(2, 1, 6, 8) visibility of the last 6 of 8 positions: causal, with holes, and a row (1, 3) that sees
    nothing."""
    mask = torch.ones(6, 8).tril(2).bool().repeat(2, 1, 1, 1)
    mask[0, 0, 2, 1:4] = mask[1, 0, 4, ::2] = False
    mask[1, 0, 3] = False
    return mask


#: the explicit mask on top of documents and query scaling (n_i counts the mask), p = 2 and ALiBi where they run
MASKED = {"dense": dict(softmax_p=2.0, distance="alibi", query_scaling="sqrt_log_n", doc_masking=True),
          "tiled": dict(softmax_p=2.0, distance="alibi", query_scaling="sqrt_log_n", doc_masking=True),
          "sdpa": dict(query_scaling="sqrt_log_n", doc_masking=True),
          "cpu_flash": dict(distance="alibi", query_scaling="sqrt_log_n", doc_masking=True)}


@pytest.mark.parametrize("backend", list(MASKED))
def test_explicit_mask_gradcheck_and_bfloat16(backend):
    """`attend(mask=...)`: a float64 gradcheck (q, k, v, multiplier), and bfloat16 against the float64 oracle."""
    spec, mask = AttentionSpec(**MASKED[backend]), explicit_mask()
    q, k, v, mult = inputs()
    args = [t.requires_grad_() for t in (q, k, v, mult)]
    assert torch.autograd.gradcheck(lambda q, k, v, m: run(backend, q, k, v, spec, DOCS, m, mask), args,
                                    fast_mode=True)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in args[:3]]
    ref = [t.detach().double().requires_grad_() for t in low]
    out = run(backend, *low, spec, DOCS, mult.detach().to(torch.bfloat16), mask)
    want = attend(*ref, spec, doc_ids=DOCS, multipliers=mult.detach().to(torch.bfloat16).double(), mask=mask,
                  backend="dense")
    assert (out[1, :, 3] == 0).all()
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = [out, *torch.autograd.grad(out, low, gout.to(out.dtype))]
    errors = relative_errors(got, [want.detach(), *torch.autograd.grad(want, ref, gout)])
    assert max(errors) <= BF16, errors


# ---------------------------------------------------------------------------------------------------
# the Attention layer: QK-norm, positions, out-norm, gates and learnable scaling around attend

LAYER_OPTIONS = {
    **{name: changes for name, (changes, _) in MODULE_OPTIONS.items()},
    "prope_min_freq": dict(position="prope", prope_fraction=0.5, rope_min_freq=1 / 64),
    "head_layer_affine": dict(out_norm="head_layer", out_norm_affine=True),
    "gate_head_2sigmoid_width": dict(gate="head", gate_act="2sigmoid", gate_width=5),
    "gate_elementwise_sigmoid": dict(gate="elementwise"),
}
#: head_dim 8 (4 pairs) and 4 heads, so that every knob changes the layer (`test_every_knob_changes_its_cells`):
#: at head_dim 4 p-RoPE's fraction 0.5 and 0.75 both rotate one pair, which never reaches rope_min_freq, the
#: default base_scale 1/sqrt(4) is MODULE_OPTIONS' 0.5, and kv_heads=2 of 2 heads is no GQA
DIM, HEADS, HEAD_DIM = 8, 4, 8


def layer_cells() -> list:
    """(option, backend): every layer option on dense; those that change what the layer hands `attend` (a learnable
    multiplier, a scalar for global and layer scaling; GQA's fewer key/value heads) on every CPU backend with a
    backward that runs them (the other options' math around `attend` is the same on every backend)."""
    probe = torch.empty(1, HEADS, 4, HEAD_DIM)
    return [pytest.param(option, backend, id=f"{option}-{backend}") for backend in TRAINING for option in LAYER_OPTIONS
            if backend == "dense" or {"learnable_scaling", "kv_heads"} & set(LAYER_OPTIONS[option])
            and backends.unsupported(backend, AttentionSpec(**LAYER_OPTIONS[option]), probe, True) is None]


def layer_and_input(changes: dict, seed: int = 0, backend: str = "dense") -> tuple[Attention, torch.Tensor]:
    """A float64 layer with every parameter moved off its init (so that unit norm weights and zero gates are
    generic), and x (2, 8, DIM)."""
    torch.manual_seed(seed)
    layer = Attention(DIM, HEADS, AttentionSpec(**changes), head_dim=HEAD_DIM, backend=backend).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer, torch.randn(2, 8, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))


@pytest.mark.parametrize("option, backend", layer_cells())
def test_layer_gradcheck_every_option(option, backend):
    """x and every parameter of the layer (projections, QK-norm and out-norm weights, gate, multiplier)."""
    layer, x = layer_and_input(LAYER_OPTIONS[option], backend=backend)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]

    def forward(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values)), (x, DOCS))

    assert torch.autograd.gradcheck(forward, (x.requires_grad_(), *params), fast_mode=True)


@pytest.mark.parametrize("mode", ["bfloat16", "autocast"])
@pytest.mark.parametrize("option, backend", layer_cells())
def test_layer_bfloat16_every_option_against_float64(option, backend, mode):
    """A bfloat16 layer (weights, x and every intermediate rounded to bfloat16, attend in float32), or a float32
    layer under bfloat16 autocast as training runs it (the projections in bfloat16, a LayerNorm QK-norm in float32,
    float32 gradients), against the same weights and x in float64: output and gradients of x and of every parameter
    within a few bfloat16 roundings of their size (the layer chains a few rounded products; at most 3.6 and 4.4 of
    them measured). A scalar multiplier's gradient sums one term per head and position, whose signs may cancel
    (log_bn_global's was 0.003 against about 0.5 at 2 heads of 4 channels): its error is measured against the
    layer's largest parameter gradient entry. The reference runs on the dense oracle."""
    layer, x = layer_and_input(LAYER_OPTIONS[option], backend=backend)
    low = layer.to(torch.bfloat16 if mode == "bfloat16" else torch.float32)
    ref = Attention(DIM, HEADS, low.spec, head_dim=HEAD_DIM, backend="dense").double()
    ref.load_state_dict(low.state_dict())
    x_low = x.to(low.q_proj.weight.dtype).requires_grad_()
    x_ref = x_low.detach().double().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        out = low(x_low, DOCS)
    want = ref(x_ref, DOCS)
    assert out.dtype == torch.bfloat16
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = [out, *torch.autograd.grad(out, [x_low, *low.parameters()], gout.to(out.dtype))]
    wanted = [want.detach(), *torch.autograd.grad(want, [x_ref, *ref.parameters()], gout)]
    errors = relative_errors(got, wanted, floor=max(float(w.abs().max()) for w in wanted[2:]))
    assert max(errors) <= 8 * BF16, dict(zip(["out", "x", *(n for n, _ in low.named_parameters())], errors))


def explicit_layer(layer: Attention, x: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The layer's output from the formulas in plain torch, without lengthgen's functions: QK-norm over head_dim
    (RMSNorm ``x / sqrt(mean x^2 + eps)``, LayerNorm ``(x - mean) / sqrt(var + eps)``, then the weight); RoPE as
    the complex pairs ``(x_i + i x_{i + D/2}) e^{i pos f_i}``, the first ``floor(fraction D / 2)`` rotating (p-RoPE)
    with ``f_i = theta^(-2i/D)`` or log-spaced from 1 down to rope_min_freq (checked to float32 rounding, the
    buffer's precision, then taken from it); attention by `naive_attention`'s loops; the out-norm of each head's
    channels or of all of them, then its affine per merged channel; the gate ``act(x[..., :w] W_g^T)`` per head or
    per channel; o_proj. A choice it has no formula for raises."""
    spec, (b, length, dim), heads, kv, d = layer.spec, x.shape, layer.heads, layer.kv_heads, layer.head_dim

    def project(linear, h):
        return F.linear(x, linear.weight, linear.bias).view(b, length, h, d).transpose(1, 2)

    def norm(t, kind, eps):
        if kind == "layer":
            t = t - t.mean(-1, keepdim=True)
        elif kind != "rms":
            raise NotImplementedError(f"explicit_layer has no formula for norm {kind!r}")
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    q, k, v = project(layer.q_proj, heads), project(layer.k_proj, kv), project(layer.v_proj, kv)
    if spec.qk_norm != "none":
        q, k = norm(q, spec.qk_norm, spec.qk_norm_eps), norm(k, spec.qk_norm, spec.qk_norm_eps)
        if spec.qk_norm_affine:
            q, k = q * layer.q_norm_weight, k * layer.k_norm_weight
    if spec.position not in ("nope", "rope", "prope"):
        raise NotImplementedError(f"explicit_layer has no formula for position {spec.position!r}")
    if spec.position != "nope":
        rotated = math.floor((1.0 if spec.position == "rope" else spec.prope_fraction) * d / 2)
        freqs = [spec.rope_theta ** (-2 * i / d) if spec.rope_min_freq is None else
                 spec.rope_min_freq ** (i / max(rotated - 1, 1)) for i in range(rotated)]
        want = torch.tensor(freqs + [0.0] * (d // 2 - rotated), dtype=torch.float64)
        torch.testing.assert_close(layer.rope_freqs, want, rtol=2e-6, atol=0)
        turn = torch.polar(torch.ones(length, d // 2, dtype=torch.float64),
                           torch.arange(length, dtype=torch.float64)[:, None] * layer.rope_freqs)

        def rotate(t):
            z = torch.complex(t[..., :d // 2], t[..., d // 2:]) * turn
            return torch.cat([z.real, z.imag], -1)
        q, k = rotate(q), rotate(k)
    m = layer.scaling.multiplier
    mult = torch.full((heads,), spec.scaling_init, dtype=torch.float64) if m is None else m.detach().expand(heads)
    y = naive_attention(q.detach(), k.detach(), v.detach(), spec, docs, mult).transpose(1, 2)    # (B, L, H, D)
    if spec.out_norm != "none":
        kind = spec.out_norm.split("_")
        y = norm(y, kind[1], spec.out_norm_eps) if kind[0] == "head" else \
            norm(y.reshape(b, length, 1, heads * d), kind[1], spec.out_norm_eps)
    y = y.reshape(b, length, heads * d)
    if spec.out_norm_affine and spec.out_norm != "none":
        y = y * layer.out_norm.weight + (layer.out_norm.bias if spec.out_norm.endswith("layer") else 0)
    if spec.gate != "none":
        gate = torch.sigmoid(x[..., :spec.gate_width or dim] @ layer.gate.weight.T)     # (B, L, H or H*D)
        gate = {"sigmoid": gate, "2sigmoid": 2 * gate}[spec.gate_act]
        y = y * {"head": gate.repeat_interleave(d, -1), "elementwise": gate}[spec.gate]
    return F.linear(y, layer.o_proj.weight, layer.o_proj.bias)


@pytest.mark.parametrize("option", list(LAYER_OPTIONS))
def test_layer_equals_explicit_formulas_every_option(option):
    """The values of every layer option against `explicit_layer` (its gradients: the layer gradchecks above)."""
    layer, x = layer_and_input(LAYER_OPTIONS[option])
    with torch.no_grad():
        torch.testing.assert_close(layer(x, DOCS), explicit_layer(layer, x, DOCS), rtol=1e-10, atol=1e-10)


def knob_off(changes: dict, field: str) -> AttentionSpec | None:
    """The option ``changes`` with ``field`` back at its default, or None where that is no valid spec (a learnable
    multiplier needs its query scaling: the choice is read by definition)."""
    try:
        return AttentionSpec(**{f: v for f, v in changes.items() if f != field})
    except ConfigError:
        return None


def unchanged(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float64 rounding (a base_scale equal to the default's takes another path to the same logits)."""
    return bool((got - want).abs().max() <= 1e-12 * want.abs().max())


def test_every_knob_changes_its_cells():
    """A field that an option sets away from its default but that its cells' output does not read tests nothing: at
    the layer cells' former head_dim 4, p-RoPE's fraction 0.5 rotated as many pairs as the default 0.75, the
    rope_min_freq option (its key taken twice in LAYER_OPTIONS, the second a p-RoPE rotating one pair) never reached
    its minimum frequency, base_scale=0.5 was the default 1/sqrt(4) and kv_heads=2 of 2 heads no GQA. Each field
    reset to its default changes the dense output of the option's cells (attend's, with the multiplier they pass) or
    the layer's output with the same weights (or its parameters). Exempt: scaling_init where a multiplier replaces it
    (passed to attend, or a learnable one moved off its init by the cells; the fixed one is read by log_n_s)."""
    silent = []
    q, k, v, per_head = inputs()
    for option, changes in OPTIONS.items():
        mult = multiplier(option, per_head)
        out = run("dense", q, k, v, AttentionSpec(**changes), DOCS, mult)
        for field in changes:
            spec = knob_off(changes, field)
            if spec is None or field == "scaling_init" and mult is not None:
                continue
            if unchanged(run("dense", q, k, v, spec, DOCS, mult if spec.query_scaling != "none" else None), out):
                silent.append(f"{option}.{field}")
    assert "scaling_init" in OPTIONS["log_n_s"] and multiplier("log_n_s", per_head) is None
    for option, changes in LAYER_OPTIONS.items():
        layer, x = layer_and_input(changes)
        for field in changes:
            spec = knob_off(changes, field)
            if spec is None or field == "scaling_init" and spec.learnable_scaling != "none":
                continue
            other = Attention(DIM, HEADS, spec, head_dim=HEAD_DIM).double()
            shapes = [{n: t.shape for n, t in m.state_dict().items()} for m in (layer, other)]
            if shapes[0] != shapes[1]:
                continue                                                    # other parameters: the field is read
            other.load_state_dict(layer.state_dict())
            if unchanged(other(x, DOCS), layer(x, DOCS)):
                silent.append(f"layer {option}.{field}")
    assert not silent, f"set away from the default, read by no cell: {', '.join(silent)}"
