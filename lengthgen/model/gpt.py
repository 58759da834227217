"""`GPT`: a decoder-only transformer whose attention layers are `lengthgen.attention.Attention`.

There is no positional embedding: positions come from each layer's AttentionSpec (RoPE, p-RoPE, ALiBi, ...
or none). Heads: ``lm`` (B, L, V) logits, ``regress`` (B, L) one scalar per position, ``classify`` (B, C)
logits read at the last position.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lengthgen.attention import Attention, AttentionSpec
from lengthgen.attention.extras import QueryScaling
from lengthgen.model.config import FINAL_NORM_PLACEMENTS, GPTConfig
from lengthgen.model.norms import HeadNormLinear, make_norm


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = max(1, int(round(cfg.mlp_ratio * cfg.dim)))
        self.fc = nn.Linear(cfg.dim, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.dim, bias=False)
        self.kind = cfg.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.gelu(h) if self.kind == "gelu" else F.relu(h).square()
        return self.proj(h)


def hybrid_spec(spec: AttentionSpec, norm: str) -> AttentionSpec:
    """HybridNorm's attention: the spec's QK-norm, or the model's norm kind when the spec has none."""
    if spec.qk_norm != "none":
        return spec
    return spec.replace(qk_norm="rms" if norm == "rms" else "layer")


class Block(nn.Module):
    """One transformer layer. ``placement``: pre | post | peri | hybrid | hybrid_first (see `GPTConfig`)."""

    def __init__(self, cfg: GPTConfig, spec: AttentionSpec, index: int, placement: str,
                 multiplier: nn.Parameter | None = None) -> None:
        super().__init__()
        self.placement = placement
        hybrid = placement.startswith("hybrid")
        if hybrid:
            spec = hybrid_spec(spec, cfg.norm)
        self.attn = Attention(cfg.dim, cfg.heads, spec, layer_index=index, head_dim=cfg.head_dim,
                              backend=cfg.attention_backend, multiplier=multiplier)
        if hybrid:  # the V part of QKV-norm
            self.attn.v_proj = HeadNormLinear(self.attn.v_proj, self.attn.head_dim, spec.qk_norm,
                                              spec.qk_norm_eps, spec.qk_norm_affine)
        self.mlp = MLP(cfg)
        norm = lambda: make_norm(cfg.norm, cfg.dim, cfg.norm_eps)  # noqa: E731
        self.norm1 = norm() if placement in ("pre", "post", "peri", "hybrid_first") else None
        self.norm2 = norm()
        self.norm1_out = norm() if placement == "peri" else None
        self.norm2_out = norm() if placement == "peri" else None
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        p = self.placement
        if p == "pre":
            x = x + self.drop(self.attn(self.norm1(x), doc_ids))
            return x + self.drop(self.mlp(self.norm2(x)))
        if p == "post":
            x = self.norm1(x + self.drop(self.attn(x, doc_ids)))
            return self.norm2(x + self.drop(self.mlp(x)))
        if p == "peri":
            x = x + self.drop(self.norm1_out(self.attn(self.norm1(x), doc_ids)))
            return x + self.drop(self.norm2_out(self.mlp(self.norm2(x))))
        # hybrid / hybrid_first: y = x + MHA_qkvnorm(x); z = N(y); x' = z + FFN(z)
        h = self.norm1(x) if self.norm1 is not None else x
        y = x + self.drop(self.attn(h, doc_ids))
        z = self.norm2(y)
        return z + self.drop(self.mlp(z))


class GPT(nn.Module):
    """Decoder-only transformer with per-layer attention specs (`GPTConfig.layer_specs`).

    ``forward(tokens, doc_ids=None)``: tokens (B, L) long -> (B, L, V) logits (``lm``), (B, L) (``regress``)
    or (B, C) (``classify``). ``loss(output, batch)`` -> (scalar, per-position (B, L) or per-sequence (B,)).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size is None: set it (training runs fill it from the task)")
        self.config = cfg = config
        self.head_kind = cfg.resolved_head
        specs = cfg.layer_specs()
        # learnable_scaling="global": ONE multiplier shared by every layer that asks for a global one
        first_global = next((s for s in specs if s.learnable_scaling == "global"), None)
        self.scaling_multiplier = (QueryScaling.new_parameter(first_global, cfg.heads)
                                   if first_global is not None else None)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.blocks = nn.ModuleList(
            Block(cfg, spec, i, cfg.placement(i),
                  self.scaling_multiplier if spec.learnable_scaling == "global" else None)
            for i, spec in enumerate(specs))
        self.final_norm = (make_norm(cfg.norm, cfg.dim, cfg.norm_eps)
                           if cfg.norm_placement in FINAL_NORM_PLACEMENTS else None)
        if self.head_kind == "lm":
            self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        elif self.head_kind == "regress":
            self.head = nn.Linear(cfg.dim, 1)
        else:
            self.head = nn.Linear(cfg.dim, cfg.num_classes)
        self.reset_parameters()
        if self.head_kind == "lm" and cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    # -- init ----------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """normal(0, init_std) for linear and embedding weights, zero biases, norms at identity; attention
        gates (`OutputGate`, not linear layers) keep their own init: 2sigmoid gates start at zero weight."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    @property
    def attentions(self) -> list[Attention]:
        return [block.attn for block in self.blocks]

    # -- forward -------------------------------------------------------------------------------------
    def features(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states (B, L, dim), after the final norm."""
        if tokens.dim() != 2:
            raise ValueError(f"GPT expects (batch, length) tokens, got shape {tuple(tokens.shape)}")
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x, doc_ids)
        return self.final_norm(x) if self.final_norm is not None else x

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.features(tokens, doc_ids)
        if self.head_kind == "classify":
            return self.head(x[:, -1])
        out = self.head(x)
        if self.head_kind == "regress":
            return out.squeeze(-1)
        cap = self.config.logit_cap
        return cap * torch.tanh(out / cap) if cap else out

    # -- loss ----------------------------------------------------------------------------------------
    def loss(self, output: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(scalar training loss, unreduced loss) honoring ``batch.loss_mask``.

        ``lm``: cross-entropy per position (B, L); the scalar adds ``z_loss * mean(logsumexp^2)`` over the
        masked positions (the unreduced loss is the cross-entropy only). ``regress``: L1 per position (B, L).
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

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


__all__ = ["GPT", "GPTConfig", "Block", "MLP", "hybrid_spec"]
