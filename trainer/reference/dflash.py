"""DFlash draft model: remote code shipped next to exported weights.

Load with ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` (config.json's ``auto_map`` points here).
Self-contained: imports only torch and transformers; tested under transformers 4.57 and 5.x. Its cache is
transformers' own ``DynamicCache`` (``update(key, value, layer_idx)``, cropped after drafting).

Layout (unprefixed ``model.safetensors``): ``fc`` [H, n_feat*H], ``hidden_norm``, ``norm`` and per layer
``layers.i.self_attn.{q,k,v,o}_proj``, ``layers.i.self_attn.{q,k}_norm``, ``layers.i.mlp.{gate,up,down}_proj``,
``layers.i.{input,post_attention}_layernorm``. The embedding and LM head are the target's, passed at run time.

Data flow: context = hidden_norm(fc(concat of the target's hidden_states[l+1] for l in target_layer_ids));
every layer attends from the block [token, MASK, ...] to [context ; block] with the same k/v projections
(KV injection), no causal mask, RoPE at absolute positions. Block slot k predicts the token at start+k.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel


def _dflash_field(config, name, default=None):
    """A DFlash setting: ``dflash_config.<name>`` first, then top-level ``<name>``."""
    sub = getattr(config, "dflash_config", None) or {}
    if not isinstance(sub, dict):
        sub = vars(sub)
    if sub.get(name) is not None:
        return sub[name]
    value = getattr(config, name, None)
    return default if value is None else value


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x, cos, sin):
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def _kv(self, h, cos, sin):
        b, t, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(self, hidden_states, target_hidden, rope_ctx, rope_q, attention_mask=None, cache=None):
        b, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, q_len, self.num_heads, self.head_dim)
        q = _apply_rope(self.q_norm(q).transpose(1, 2), *rope_q)
        k_ctx, v_ctx = self._kv(target_hidden, *rope_ctx)
        k_noise, v_noise = self._kv(hidden_states, *rope_q)
        k = torch.cat([k_ctx, k_noise], dim=2)
        v = torch.cat([v_ctx, v_noise], dim=2)
        if cache is not None:
            # transformers' Cache API: update(key, value, layer_idx) appends and returns everything cached.
            # The block's own K/V go in too; the caller crops them away after drafting (crop to `start`).
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # GQA without relying on SDPA's enable_gqa (older torch)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, rope_ctx, rope_q, attention_mask=None, cache=None):
        h = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), target_hidden, rope_ctx, rope_q, attention_mask, cache
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The DFlash drafter. ``forward`` drafts hidden states; ``spec_generate`` runs greedy speculative decoding."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    _can_record_outputs = {}

    def __init__(self, config):
        super().__init__(config)
        self.block_size = int(_dflash_field(config, "block_size", 16))
        self.mask_token_id = _dflash_field(config, "mask_token_id")
        self.target_layer_ids = list(_dflash_field(config, "target_layer_ids") or [])
        if self.mask_token_id is None or not self.target_layer_ids:
            raise ValueError("config.json needs dflash_config.mask_token_id and dflash_config.target_layer_ids")
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.rope_theta = _rope_theta(config)
        self.post_init()

    def _cos_sin(self, position_ids, dtype):
        # Recomputed per call (not a buffer), so loading on a meta device never leaves it uninitialised.
        dev = self.fc.weight.device
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        freqs = position_ids.to(dev).float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extract_context_feature(self, hidden_states):
        """Concatenate the target's hidden_states[l+1] for l in target_layer_ids -> [B, T, n_feat*H]."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def forward(self, noise_embedding, target_hidden, position_ids, attention_mask=None, past_key_values=None, **kwargs):
        """Draft hidden states for the block(s).

        Args:
            noise_embedding: [B, Q, H] target embeddings of [token, MASK, ...].
            target_hidden: [B, S, n_feat*H] raw target features of the (new) context positions.
            position_ids: [B, S + Q] positions of the context then of the block.
            attention_mask: optional bool [B, 1, Q, S_total + Q] (True = attend); None = all visible.
            past_key_values: optional transformers Cache (e.g. ``DynamicCache()``): the context and block K/V
                are appended with ``update(key, value, layer_idx)``; crop it back to the block start afterwards
                (``draft_block`` does) so the next call appends only newly committed context.

        Returns:
            [B, Q, H] final-normed hidden states (apply the target's lm_head for logits).
        """
        dtype = self.fc.weight.dtype
        x = noise_embedding.to(dtype)
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        s = ctx.shape[1]
        cos, sin = self._cos_sin(position_ids, dtype)
        rope_ctx, rope_q = (cos[:, :s], sin[:, :s]), (cos[:, s:], sin[:, s:])
        for layer in self.layers:
            x = layer(x, ctx, rope_ctx, rope_q, attention_mask, past_key_values)
        return self.norm(x)

    @staticmethod
    def crop_cache(cache, length):
        """Keep the first ``length`` positions of a transformers Cache.

        Only the negative form of ``crop`` ("drop that many from the end") means the same in transformers 4.57
        and 5.x; 5.x refuses a positive argument.
        """
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    def draft_block(self, target, token, start, context, context_pos, cache, block_size=None):
        """Draft logits for the block that starts at ``start`` with the committed ``token``.

        Args:
            target: the target model (its embedding and LM head are borrowed).
            token: the committed token at position ``start`` (an int).
            start: the block's first position.
            context: [1, n, n_feat*H] target features of the positions committed since the last call.
            context_pos: [1, n] their positions (all < start).
            cache: a transformers ``DynamicCache`` owned by the caller, one per prompt.
            block_size: test-time block (default: the trained one).

        Returns:
            [bs - 1, V] float32 logits for positions start+1 .. start+bs-1. The cache holds the context up to
            ``start`` afterwards (the block's own K/V are cropped away).
        """
        bs = block_size or self.block_size
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        dev = embed.weight.device
        block = torch.full((1, bs), int(self.mask_token_id), dtype=torch.long, device=dev)
        block[0, 0] = token
        pos = torch.cat([context_pos.to(dev), torch.arange(start, start + bs, device=dev)[None]], dim=1)
        hidden = self(embed(block), context, pos, past_key_values=cache)
        self.crop_cache(cache, start)
        w = head.weight
        return F.linear(hidden[0, 1:].to(w.dtype), w).float()

    @torch.no_grad()
    def spec_generate(
        self,
        target,
        input_ids,
        max_new_tokens=256,
        stop_token_ids=None,
        temperature=0.0,
        block_size=None,
        return_stats=False,
    ):
        """Greedy speculative decoding of one prompt with ``target`` (an HF causal LM).

        Rounds continue while fewer than ``max_new_tokens`` tokens have gone through a verify round (the
        token from the prefill counts only once verified), then the output is cut to prompt +
        ``max_new_tokens`` tokens and after the first stop token: the counting of the published DFlash
        benchmark. The acceptance length of a round is accepted drafts + 1.

        Args:
            target: the target model (its embedding and LM head are used by the drafter).
            input_ids: [1, P] prompt.
            max_new_tokens: tokens to generate.
            stop_token_ids: stop after a round that committed one of these.
            temperature: only 0 (greedy) is implemented here.
            block_size: test-time block, default the trained one.
            return_stats: also return the acceptance length of every round.

        Returns:
            [1, P + generated] ids (and, with return_stats, the list of acceptance lengths).

        Raises:
            NotImplementedError: temperature > 0.
            ValueError: batch size other than 1.
        """
        if temperature and temperature > 0:
            raise NotImplementedError("this reference implementation decodes greedily only (temperature=0)")
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate decodes one prompt at a time (batch size 1)")
        bs = block_size or self.block_size
        stop = set(stop_token_ids or [])
        cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        dev = target.get_input_embeddings().weight.device
        input_ids = input_ids.to(dev)
        prompt_len = input_ids.shape[1]
        tcache, dcache = DynamicCache(), DynamicCache()

        def verify(ids, start):
            pos = torch.arange(start, start + ids.shape[1], device=dev)[None]
            out = target(input_ids=ids, position_ids=pos, use_cache=True, output_hidden_states=True, **{cache_kw: tcache})
            return out.logits, self.extract_context_feature(out.hidden_states)

        logits, feats = verify(input_ids, 0)
        tokens = [int(logits[0, -1].argmax())]
        accept_lens = []
        new_feats, new_pos = feats, torch.arange(prompt_len, device=dev)[None]
        start = prompt_len
        while start < prompt_len + max_new_tokens:
            block = [tokens[-1]]
            if bs > 1:
                drafts = self.draft_block(target, tokens[-1], start, new_feats, new_pos, dcache, bs)
                block += drafts.argmax(-1).tolist()
            logits, feats = verify(torch.tensor([block], device=dev), start)
            verdict = logits[0].argmax(-1).tolist()
            n = 0
            while n < bs - 1 and block[n + 1] == verdict[n]:
                n += 1
            accept_lens.append(n + 1)
            self.crop_cache(tcache, start + n + 1)
            tokens += block[1 : n + 1] + [verdict[n]]
            new_feats = feats[:, : n + 1]
            new_pos = torch.arange(start, start + n + 1, device=dev)[None]
            start += n + 1
            if stop & set(tokens):
                break
        tokens = tokens[:max_new_tokens]
        for i, tok in enumerate(tokens):
            if tok in stop:
                tokens = tokens[: i + 1]
                break
        out = torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype, device=dev)], dim=1)
        return (out, accept_lens) if return_stats else out
