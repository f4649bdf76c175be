"""The DFlash drafter (docs/dflash.md §1.1–1.4): Qwen3-style layers with KV injection.

One draft step, in shapes (B batch, S context, Q = blocks * bs queries, H hidden, F = n_feat * H):

    ctx   = hidden_norm(fc(target_hidden))            [B, S, H]   once per step, shared by every layer
    x     = embed_tokens(noise_ids)                   [B, Q, H]   target's frozen table: [anchor, MASK, ...]
    each layer:  q = q_norm(q_proj(ln(x)))            [B, Hq, Q, D]
                 k = k_norm(k_proj(cat[ctx, ln(x)]))  [B, Hkv, S+Q, D]   (same weights for context and noise)
                 v = v_proj(cat[ctx, ln(x)])
                 RoPE at absolute positions, non-causal attention under the §2.3 mask, o_proj, SwiGLU MLP
    hidden = norm(x)                                  [B, Q, H]  -> target's frozen lm_head -> logits

The embedding and LM head are the target's, borrowed (frozen, not parameters of this module, not in its
state_dict): the exported weights are exactly the 11 tensors per layer + fc, hidden_norm, norm (§1.6).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
import torch.nn.functional as F

from trainer.attention import attend, resolve_backend
from trainer.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DrafterConfig:
    """Resolved drafter geometry (ModelConfig with every size filled in from the target)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    attention_backend: str = "auto"
    dtype: str = "float32"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for GQA"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target's embedding table (0..{self.vocab_size - 1}); "
                "pick an unused id below the vocabulary size"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: statistics in float32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, h, T, D]; cos/sin [B, T, D] -> broadcast over heads.
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DraftCache:
    """Per-layer K/V of the context (target features) for spec decoding.

    Context K/V depend only on the features at each position (the context never passes through the
    draft layers), so they are computed once when a position is committed and appended; the block's own
    K/V are recomputed every round and never stored (the reference "crop to start").
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[2])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        elif k.shape[2]:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.scale = D**-0.5

    def _kv(self, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, x, ctx, rope_ctx, rope_q, mask, cache: DraftCache | None = None, layer: int = 0):
        """x [B, Q, H] (normed noise), ctx [B, S, H] (fused context) -> [B, Q, H]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, *rope_q)
        k_ctx, v_ctx = self._kv(ctx, *rope_ctx)  # KV injection: context through the same k/v projections
        if cache is not None:
            k_ctx, v_ctx = cache.append(layer, k_ctx, v_ctx)
        k_noise, v_noise = self._kv(x, *rope_q)
        k = torch.cat([k_ctx, k_noise], dim=2)
        v = torch.cat([v_ctx, v_noise], dim=2)
        out = attend(q, k, v, mask, self.scale)  # [B, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_ctx, rope_q, mask, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_ctx, rope_q, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Borrowed:
    """Holds the target's frozen embedding and LM head without registering them on the drafter.

    A plain object (not an nn.Module) is invisible to parameters(), state_dict() and the optimizer.
    """

    def __init__(self, embed: nn.Module | None, lm_head: nn.Module | None):
        self.embed = embed
        self.lm_head = lm_head


class DFlashDrafter(nn.Module):
    """The drafter. See the module docstring for the data flow.

    Args:
        cfg: resolved geometry.
        embed_tokens: the target's input embedding (frozen, borrowed).
        lm_head: the target's LM head (frozen, borrowed).
    """

    def __init__(self, cfg: DrafterConfig, embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_features * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self._borrowed = _Borrowed(embed_tokens, lm_head)
        self.reset_parameters()
        self.to(_DTYPES[cfg.dtype])

    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3 initialisation: N(0, std) linears, unit norms (uses the global torch RNG)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    # ---------------------------------------------------------------------------------------- borrowing
    @property
    def embed_tokens(self) -> nn.Module:
        if self._borrowed.embed is None:
            raise RuntimeError("drafter has no embedding: build it with DFlashDrafter.from_target(model_cfg, target, "
                               "mask_token_id) or DFlashDrafter(cfg, embed_tokens=..., lm_head=...)")
        return self._borrowed.embed

    @property
    def lm_head(self) -> nn.Module:
        if self._borrowed.lm_head is None:
            raise RuntimeError("drafter has no LM head: build it with DFlashDrafter.from_target(model_cfg, target, "
                               "mask_token_id) or DFlashDrafter(cfg, embed_tokens=..., lm_head=...)")
        return self._borrowed.lm_head

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def backend(self) -> str:
        """The attention backend this drafter uses on its current device ("flex" or "sdpa")."""
        return resolve_backend(self.cfg.attention_backend, self.device)

    # -------------------------------------------------------------------------------------------- parts
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Frozen target embedding of ``ids``, in the drafter's dtype/device."""
        with torch.no_grad():
            e = self.embed_tokens(ids.to(self.embed_tokens.weight.device))
        return e.to(device=self.device, dtype=self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target LM head on drafter hidden states (gradients flow to ``hidden``, not to the head).

        Args:
            hidden: [..., H] output of `forward`.

        Returns:
            [..., V] logits in the head's dtype.
        """
        w = self.lm_head.weight
        return F.linear(hidden.to(device=w.device, dtype=w.dtype), w, getattr(self.lm_head, "bias", None))

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(features)): [B, S, F] -> [B, S, H]."""
        return self.hidden_norm(self.fc(target_hidden.to(device=self.device, dtype=self.dtype)))

    def _cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Frequencies are recomputed from the config (not a buffer): always float32 whatever the weights'
        # dtype, and never part of the exported state.
        D = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, D, 2, device=self.device, dtype=torch.float32) / D))
        freqs = position_ids.to(self.device).float()[..., None] * inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # ------------------------------------------------------------------------------------------ forward
    def forward(
        self,
        noise_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask=None,
    ) -> torch.Tensor:
        """Training forward over many blocks at once.

        Args:
            noise_ids: [B, Q] block tokens (slot 0 = clean anchor token, others MASK), Q = N * bs.
            target_hidden: [B, S, F] target features of the whole row (the mask hides what a block must not see).
            position_ids: [B, S + Q] absolute RoPE positions: context positions, then block positions.
            attn_mask: from `trainer.attention.build_mask` (BlockMask or dense bool [B, 1, Q, S+Q]); None = all visible.

        Returns:
            [B, Q, H] final-normed hidden states (feed to `logits`).

        Raises:
            ValueError: inconsistent shapes.
        """
        B, Q = noise_ids.shape
        S = target_hidden.shape[1]
        if position_ids.shape != (B, S + Q):
            raise ValueError(f"position_ids must be [B, S+Q] = [{B}, {S + Q}], got {tuple(position_ids.shape)}")
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"target_hidden has {target_hidden.shape[-1]} features per token, the drafter expects "
                f"{self.fc.in_features} (= {self.cfg.num_features} layers x {self.cfg.hidden_size})"
            )
        x = self.embed(noise_ids)
        ctx = self.fuse(target_hidden)
        cos, sin = self._cos_sin(position_ids)
        rope_ctx, rope_q = (cos[:, :S], sin[:, :S]), (cos[:, S:], sin[:, S:])
        for layer in self.layers:
            x = layer(x, ctx, rope_ctx, rope_q, attn_mask)
        return self.norm(x)

    def new_cache(self) -> DraftCache:
        """An empty context cache for `draft_step`."""
        return DraftCache(len(self.layers))

    def draft_step(
        self,
        block_ids: torch.Tensor,
        new_target_hidden: torch.Tensor,
        new_positions: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DraftCache,
    ) -> torch.Tensor:
        """Inference forward of one block with a context cache (spec decoding, §1.5).

        The block sees every cached context position plus the new ones appended here, and itself; the
        caller guarantees all of them are < the block's first position. Nothing of the block is cached.

        Args:
            block_ids: [B, bs] = [token at start, MASK, ...].
            new_target_hidden: [B, n, F] features of the positions committed since the last call (n may be 0).
            new_positions: [B, n] their positions.
            block_positions: [B, bs] = start .. start+bs-1.
            cache: from `new_cache`; extended in place with the new context.

        Returns:
            [B, bs] final-normed hidden states.
        """
        x = self.embed(block_ids)
        ctx = self.fuse(new_target_hidden)
        rope_ctx = self._cos_sin(new_positions)
        rope_q = self._cos_sin(block_positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_ctx, rope_q, None, cache, i)
        return self.norm(x)

    # ------------------------------------------------------------------------------------------- build
    @classmethod
    def from_target(cls, model_cfg: ModelConfig, target, mask_token_id: int, dtype: str = "float32") -> "DFlashDrafter":
        """Build a drafter for ``target``: sizes default to the target's, RoPE base copied from it.

        Args:
            model_cfg: drafter geometry; None fields are copied from the target.
            target: a `trainer.features.TargetModel` (its ``layer_ids`` are the feature layers).
            mask_token_id: MASK token id (a row of the target's embedding).
            dtype: the parameters' dtype ("float32", "bfloat16"; the training loop's
                `trainer.precision.Precision.master_dtype_name`).

        Returns:
            A drafter on the target's device, borrowing its embedding and head.

        Raises:
            ValueError: target_layer_ids in the config disagree with the target's, bad sizes or mask id.
        """
        ids = list(target.layer_ids)
        if model_cfg.target_layer_ids is not None and list(model_cfg.target_layer_ids) != ids:
            raise ValueError(
                f"model.target_layer_ids {list(model_cfg.target_layer_ids)} differ from the target's feature layers "
                f"{ids}; build the TargetModel with the same layer_ids"
            )
        tcfg = target.config
        cfg = DrafterConfig(
            hidden_size=target.hidden_size,
            intermediate_size=model_cfg.intermediate_size or int(tcfg.intermediate_size),
            num_layers=model_cfg.num_draft_layers,
            num_attention_heads=model_cfg.num_attention_heads or int(tcfg.num_attention_heads),
            num_key_value_heads=model_cfg.num_key_value_heads
            or int(getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads),
            head_dim=model_cfg.head_dim or target.head_dim,
            block_size=model_cfg.block_size,
            mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(ids),
            num_target_layers=target.num_layers,
            vocab_size=target.vocab_size,
            rope_theta=target.rope_theta,
            rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 40960)),
            attention_backend=model_cfg.attention_backend,
            dtype=dtype,
        )
        drafter = cls(cfg, target.embed_tokens, target.lm_head)
        return drafter.to(target.device)
