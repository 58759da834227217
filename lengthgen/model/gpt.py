"""`GPT`: a decoder-only transformer whose attention layers are `lengthgen.attention.Attention`.

Positions come from each layer's AttentionSpec (RoPE, p-RoPE, ALiBi, ... or none), plus optionally seed 001's
2-entry "position 0 or not" embedding. Heads: ``lm`` (B, L, V) logits, ``regress`` (B, L) one scalar per
position, ``classify`` (B, C) logits read at the last position. The regress and classify heads run in float32
even under autocast (a count of 5000.3 must not come out as bfloat16's 4992).

A `KVCache` lets a forward pass run only new positions after cached ones (`GPT.generate`); `GPT.logit_chunks`
gives the lm head's logits a chunk of positions at a time (long evaluations never hold all (B, L, V) logits).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from lengthgen.attention import Attention, KVCache
from lengthgen.attention.extras import QueryScaling
from lengthgen.config import ConfigError, check_value, pattern_matches
from lengthgen.model.blocks import BLOCKS, SkipGate, mlp_width
from lengthgen.model.config import GPTConfig
from lengthgen.model.norms import make_norm

#: at most this many logits per chunk of `GPT.logit_chunks` (2^24: 64 MiB in float32)
LOGIT_CHUNK = 1 << 24


def draw_(weight: torch.Tensor, std: float, kind: str) -> None:
    """Fill ``weight`` from normal(0, std) or (``kind="uniform"``) U(-sqrt(3) std, sqrt(3) std); std 0: zeros."""
    if std == 0:
        nn.init.zeros_(weight)
    elif kind == "uniform":
        nn.init.uniform_(weight, -math.sqrt(3) * std, math.sqrt(3) * std)
    else:
        nn.init.normal_(weight, mean=0.0, std=std)


class GPT(nn.Module):
    """Decoder-only transformer with per-layer attention specs (`GPTConfig.layer_specs`).

    ``forward(tokens, doc_ids=None, cache=None)``: tokens (B, L) long -> (B, L, V) logits (``lm``), (B, L)
    (``regress``) or (B, C) (``classify``); with a `KVCache` the tokens are the positions after the cached ones.
    ``loss(output, batch)`` -> (scalar, per-position (B, L) or per-sequence (B,)). ``generate`` continues a prompt.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"GPT takes a GPTConfig, got {type(config).__name__}")
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size is None: set it (training runs fill it from the task)")
        self.config = cfg = dataclasses.replace(config)      # checked again: fields may have been set since
        self.head_kind = cfg.resolved_head
        specs, attention = cfg.layer_specs(), cfg.attention_layers()
        self.value_index = list(cfg.value_embeds) or [-1] * cfg.layers
        # learnable_scaling="global": ONE multiplier shared by every layer that asks for a global one
        shared = cfg.global_scaling_spec()
        self.scaling_multiplier = None if shared is None else QueryScaling.new_parameter(shared, cfg.heads)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, scale_grad_by_freq=cfg.scale_grad_by_freq)
        self.first_embed = nn.Embedding(2, cfg.dim) if cfg.first_token_embedding else None
        self.embed_norm = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_affine) if cfg.embed_norm else None
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        block = BLOCKS[cfg.block]
        self.blocks = nn.ModuleList(
            block(cfg, spec, i, cfg.placement(i), self.scaling_multiplier if spec.learnable_scaling == "global"
                  else None, attention=attention[i], value_embed=self.value_index[i] >= 0)
            for i, spec in enumerate(specs))
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, width) for width in self._value_widths())
        self.skip_gates = nn.ModuleList(SkipGate(cfg.gate_width or cfg.dim) for _ in cfg.skips)
        self.final_norm = (make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_affine)
                           if cfg.has_final_norm else None)
        if self.head_kind == "lm":
            self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        else:
            self.head = nn.Linear(cfg.dim, 1 if self.head_kind == "regress" else cfg.num_classes)
        self.reset_parameters()
        if self.head_kind == "lm" and cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def _value_widths(self) -> list[int]:
        """The width (key/value heads x head_dim) of each value-embedding table; its layers must agree."""
        widths: dict[int, set[int]] = {}
        for i, table in enumerate(self.value_index):
            if table >= 0:
                attn = self.blocks[i].attn
                widths.setdefault(table, set()).add(attn.kv_heads * attn.head_dim)
        if sorted(widths) != list(range(len(widths))) or any(len(w) > 1 for w in widths.values()):
            raise ConfigError(f"model.value_embeds={self.value_index} is not valid; tables must be numbered 0, 1, "
                              "... and the layers sharing one must have the same key/value width",
                              "model.value_embeds")
        return [widths[t].pop() for t in range(len(widths))]

    # -- init ----------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """``init``: normal(0, init_std) or uniform with that std for linear and embedding weights, zero biases;
        or ``torch``: every module keeps PyTorch's default. Norms start at identity; attention gates
        (`OutputGate`, not linear layers) keep their own init (2sigmoid gates: zero weight); value embeddings
        start at zero (seed 000). Then ``init_overrides``, in order (patterns that match nothing are errors)."""
        cfg = self.config
        if cfg.init != "torch":
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    draw_(module.weight, cfg.init_std, cfg.init)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
        for table in self.value_embeds:
            nn.init.zeros_(table.weight)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for names, std in pattern_matches("model.init_overrides", cfg.init_overrides, list(params), "parameter"):
                for name in names:
                    draw_(params[name], std, cfg.init)

    @property
    def attentions(self) -> list[Attention]:
        return [block.attn for block in self.blocks if block.attn is not None]

    # -- forward -------------------------------------------------------------------------------------
    def features(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                 cache: KVCache | None = None) -> torch.Tensor:
        """The final hidden states (B, L, dim), after the final norm. ``cache``: tokens are the positions after
        the ``cache.length`` cached ones, whose keys and values the attention layers use and extend."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.long, torch.int32):
            got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"GPT expects (batch, length) token ids (torch.long or torch.int32), got {got}")
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError(f"GPT: cache must be a KVCache (lengthgen.attention) or None, got {type(cache).__name__}")
        if cache is not None and self.training and self.config.norm == "batch":
            raise ValueError("GPT: a KVCache needs causal layers, and norm='batch' in training mode normalizes over "
                             "every position; decode in eval mode (model.eval(): running statistics)")
        start = 0 if cache is None else cache.length
        try:
            x = self.embed(tokens)
        except IndexError:          # eager CPU only (CUDA asserts on the device); no check costs a sync
            raise ValueError(f"GPT: token ids must be in [0, {self.config.vocab_size}) (model.vocab_size), got "
                             f"ids in [{int(tokens.min())}, {int(tokens.max())}]") from None
        if self.first_embed is not None:   # seed 001: one vector for position 0, another for every later one
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
            x = x + self.first_embed((positions > 0).long())
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = x0 = self.drop(x)
        ve = [table(tokens) for table in self.value_embeds]
        skipped: dict[int, torch.Tensor] = {}
        try:
            for i, block in enumerate(self.blocks):
                for gate, (source, target) in zip(self.skip_gates, self.config.skips):
                    if target == i:   # U-net skip (seed 000): a gated copy of an earlier block's output
                        x = x + gate(x0) * skipped[source]
                table = self.value_index[i]
                x = block(x, doc_ids, ve[table] if table >= 0 else None, cache)
                if any(source == i for source, _ in self.config.skips):
                    skipped[i] = x
        except BaseException:
            if cache is not None and any(layer.seen != cache.length for layer in cache.layers.values()):
                cache.broken = True         # some layers hold the failed positions, others not
            raise
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.final_norm(x) if self.final_norm is not None else x

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        x = self.features(tokens, doc_ids, cache)
        if self.head_kind == "lm":
            return self.logits(x)
        if self.head_kind == "classify" and x.shape[1] == 0:
            raise ValueError("GPT: the classify head reads each sequence's last position, but the tokens have none "
                             f"({tuple(tokens.shape)})")
        dtype = torch.promote_types(self.head.weight.dtype, torch.float32)   # float32 scalars and class logits
        with torch.autocast(x.device.type, enabled=False):
            x = (x[:, -1] if self.head_kind == "classify" else x).to(dtype)
            out = F.linear(x, self.head.weight.to(dtype), self.head.bias.to(dtype))
        # a regression's (B, L) is a copy, not a view of the (B, L, 1) product: FSDP2 warns of a view output (an
        # in-place op on it would skip its backward hook)
        return out.squeeze(-1).clone() if self.head_kind == "regress" else out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The lm head's (capped) logits (B, L, V) of final hidden states x (B, L, dim)."""
        return self.cap_logits(self.head(x))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """`logits` computed outside autocast, in the head weights' dtype: what greedy decoding and the retrieval
        maps read (bf16 keeps 8 significant bits: a logit of 20 would move by up to 0.04, its token's probability
        by 4%, and close candidates would tie)."""
        with torch.autocast(x.device.type, enabled=False):
            return self.logits(x.to(self.head.weight.dtype))

    def logit_chunks(self, x: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """`logits` of x (B, L, dim) a chunk of positions at a time: ``(lo, hi, logits of positions lo:hi)``, each
        chunk at most `LOGIT_CHUNK` logits (at least one position), so (B, L, V) is never held at once."""
        step = max(1, LOGIT_CHUNK // (x.shape[0] * self.config.vocab_size))
        for lo in range(0, x.shape[1], step):
            hi = min(lo + step, x.shape[1])
            yield lo, hi, self.logits(x[:, lo:hi])

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logit_cap`` c: ``c tanh(x / c)`` (Gemma 2) or ``c sigmoid((x + 5) / 7.5)`` (seed 000's
        modded-nanogpt, c = 23; equal to (c/2)(tanh((x + 5) / 15) + 1))."""
        cap = self.config.logit_cap
        if not cap:
            return logits
        if self.config.logit_cap_form == "sigmoid":
            return cap * torch.sigmoid((logits + 5) / 7.5)
        return cap * torch.tanh(logits / cap)

    # -- loss ----------------------------------------------------------------------------------------
    def loss(self, output: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(scalar training loss, unreduced loss) honoring ``batch.loss_mask``, in float32.

        ``lm``: cross-entropy per position (B, L); the scalar adds ``z_loss * mean(logsumexp^2)`` (PaLM's z-loss,
        Chowdhery et al. 2022; a stability trick in seed 004) over the masked positions (the unreduced loss is the
        cross-entropy only). ``regress``: L1 per position (B, L).
        ``classify``: cross-entropy per sequence (B,); a sequence counts when any of its mask is set.
        The unreduced loss is 0 outside the mask; the scalar is its mean over the masked entries.
        """
        mask = batch.loss_mask
        if self.head_kind == "classify":
            per = F.cross_entropy(output.float(), batch.targets, reduction="none")
            weight = mask.any(-1).float() if mask is not None and mask.dim() == 2 else torch.ones_like(per)
            per = per * weight
            return per.sum() / weight.sum().clamp(min=1), per
        maskf = mask.float()
        count = maskf.sum().clamp(min=1)
        if self.head_kind == "regress":
            per = torch.where(mask, (output.float() - batch.targets.float()).abs(), torch.zeros_like(maskf))
            return per.sum() / count, per
        logits = output.float()
        targets = torch.where(mask, batch.targets, torch.zeros_like(batch.targets))  # ignore unmasked labels
        per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        per = per.view_as(maskf) * maskf
        scalar = per.sum() / count
        if self.config.z_loss:
            z = torch.logsumexp(logits, dim=-1)
            scalar = scalar + self.config.z_loss * (z.square() * maskf).sum() / count
        return scalar, per

    # -- generation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None, cache: bool = True,
                 bos_id: int | None = None, stop_ids: Sequence[int] = ()) -> torch.Tensor:
        """``prompt`` (B, L) followed by ``max_new_tokens`` tokens (B, L + max_new_tokens), each picked by
        `next_token` from the logits of the sequence so far. With ``cache`` each step runs only the newest token
        against a `KVCache`; without, the whole sequence again (the same tokens, slower). ``bos_id``: for a model
        that masks documents, the token that starts each document (as in training), prompt and continuation
        alike; without it the whole sequence is one document. ``stop_ids``: generation ends early, after the step
        at which every row has written one of these ids (as Hugging Face's ``eos_token_id``; the tokens are those
        it would have generated up to there). Runs in eval mode (the mode is restored after); the logits are
        `head_logits`, in the head's dtype even under autocast.
        lm heads only; a bad ``max_new_tokens``, ``temperature``, ``top_k``, ``bos_id`` or ``stop_ids`` is a
        `ConfigError` naming it."""
        if self.head_kind != "lm":
            raise ValueError(f"GPT.generate needs an lm head; this model's head is {self.head_kind!r}")
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.shape[1] == 0 \
                or prompt.dtype != torch.long:
            got = f"{prompt.dtype} {tuple(prompt.shape)}" if isinstance(prompt, torch.Tensor) else type(prompt).__name__
            raise ValueError(f"GPT.generate: prompt must be (batch, length >= 1) token ids (torch.long), got {got}")
        low, high = (int(prompt.min()), int(prompt.max())) if prompt.numel() else (0, 0)
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"GPT.generate: prompt token ids must be in [0, {self.config.vocab_size}) "
                             f"(model.vocab_size), got {low if low < 0 else high}")
        check_value("max_new_tokens", max_new_tokens, int, ge=0)
        temperature = check_value("temperature", temperature, float, ge=0)
        top_k = check_value("top_k", top_k, int | None, ge=1)
        bos_id = check_value("bos_id", bos_id, int | None, ge=0, lt=self.config.vocab_size)
        stop_ids = check_value("stop_ids", stop_ids, list[int], ge=0, lt=self.config.vocab_size)
        stops = torch.tensor(stop_ids, dtype=torch.long, device=prompt.device)
        stopped = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        was_training = self.training
        self.eval()
        try:
            kv = KVCache() if cache else None
            tokens = new = prompt
            docs = None if bos_id is None else (prompt == bos_id).long().cumsum(1)
            for _ in range(max_new_tokens):
                run = new if cache else tokens
                doc_ids = None if docs is None else docs[:, -run.shape[1]:]
                last = self.features(run, doc_ids, cache=kv)[:, -1:]
                new = next_token(self.head_logits(last)[:, -1], temperature, top_k, generator)
                tokens = torch.cat([tokens, new], dim=1)
                if docs is not None:
                    docs = torch.cat([docs, docs[:, -1:] + (new == bos_id).long()], dim=1)
                if stop_ids:
                    stopped |= torch.isin(new[:, 0], stops)
                    if stopped.all():
                        break
        finally:
            self.train(was_training)
        return tokens

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class NonFiniteLogitsError(ValueError):
    """`next_token`'s logits hold NaN or +inf: the model diverged, and there is no distribution to pick from."""


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, 1) next tokens from (B, V) logits: the argmax at ``temperature`` 0, else a draw (with ``generator``)
    from softmax(logits / temperature) over the ``top_k`` largest logits (all without top_k; nanoGPT's sampling).
    The logits are shifted by their maximum and divided in float64, so a tiny temperature still gives a
    distribution (the argmax's) rather than inf / inf. NaN or +inf logits (a diverged model) are a
    `NonFiniteLogitsError`: argmax would return the NaN's index and a draw has no distribution."""
    if bool((logits.isnan() | logits.isposinf()).any()):
        raise NonFiniteLogitsError("next_token: the logits hold NaN or +inf (the model's weights or activations "
                                   "diverged); there is no distribution to pick a token from")
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:     # exactly k: ties at the k-th logit are not all kept
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def forward_memory(cfg: GPTConfig, tokens: int, element_size: int = 4) -> int:
    """A lower bound on the bytes a no-grad forward pass over ``tokens`` positions (all rows together) holds at
    once, activations of ``element_size`` bytes: what the pass keeps throughout (its input x0, the U-net skips'
    sources, the value embeddings), the residual stream and a sublayer's normed input, and the widest sublayer's
    two largest tensors (an MLP's hidden and activated hidden, or attention's queries, keys, values and output),
    plus the int64 token ids. The lm head's logits are bounded apart (`LOGIT_CHUNK`). Measured peaks: 1.2x to 1.4x
    it."""
    head_dim, heads = cfg.resolved_head_dim, cfg.heads
    kv = [(spec.kv_heads or heads) * head_dim for spec, on in zip(cfg.layer_specs(), cfg.attention_layers()) if on]
    tables = {table: kv_width for table, kv_width in zip(
        [t for t, on in zip(cfg.value_embeds, cfg.attention_layers()) if on], kv) if table >= 0}
    kept = cfg.dim * (1 + len({source for source, _ in cfg.skips})) + sum(tables.values())
    widest = max([2 * mlp_width(cfg)] + [2 * heads * head_dim + 2 * width for width in kv])
    return tokens * ((kept + 2 * cfg.dim + widest) * element_size + 8)


__all__ = ["GPT", "GPTConfig", "LOGIT_CHUNK", "NonFiniteLogitsError", "draw_", "forward_memory", "next_token"]
