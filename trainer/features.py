"""The frozen target model and the features the drafter reads from it (docs/dflash.md §1.1, §1.3).

Feature convention (z-lab ids): id ``l`` is the OUTPUT of decoder layer ``l`` == HF ``hidden_states[l+1]``
(index 0 of HF's tuple is the embedding output). Features of several layers are concatenated on the last
dim in the listed order -> ``[B, S, n_feat * H]``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from trainer.config import default_target_layer_ids


def rope_theta_of(config) -> float:
    """The RoPE base of an HF config, wherever this transformers version keeps it.

    transformers 4.x has a top-level ``rope_theta``; 5.x nests it in ``rope_parameters``. A silent fallback
    to 10000 trains the drafter with the wrong RoPE base (§4), so a config without either is an error.

    Raises:
        ValueError: the config has neither.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        return float(theta)
    raise ValueError(
        f"target config ({type(config).__name__}) has no rope_theta nor rope_parameters['rope_theta']; "
        "the drafter must copy the target's RoPE base: add rope_theta to the target's config.json"
    )


def positions_from_docs(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at every document start (padding runs count as their own documents).

    Args:
        doc_ids: [B, S] document id per token (-1 = padding).

    Returns:
        [B, S] long positions.
    """
    B, S = doc_ids.shape
    idx = torch.arange(S, device=doc_ids.device).expand(B, S)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # Index of the latest document start at or before each position.
    last_start = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start


class _TargetShape:
    """What every view of a target derives from its HF config, its feature layers and its embedding."""

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    @property
    def num_features(self) -> int:
        return len(self.layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated features: n_feat * H."""
        return self.num_features * self.hidden_size

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def rope_theta(self) -> float:
        return rope_theta_of(self.config)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype


def _check_layer_ids(layer_ids: list[int], n: int) -> None:
    """Raises ValueError unless `layer_ids` is a non-empty list of layers of an n-layer target."""
    if not layer_ids:
        raise ValueError("layer_ids is empty; give at least one target layer (or use the default formula)")
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"target layer ids {bad} out of range: the target has {n} layers (ids 0..{n - 1})")


class TargetModel(_TargetShape, nn.Module):
    """A frozen HF causal LM that yields DFlash features, logits, and its embedding / LM head to borrow.

    Args:
        hf_model: any HF causal LM that returns ``hidden_states`` (Qwen3, Llama, ... tested: Qwen3, Llama).
        layer_ids: z-lab layer ids whose outputs are the features (see module docstring).

    Raises:
        ValueError: a layer id outside 0..num_layers-1, or no layer ids.
    """

    def __init__(self, hf_model: nn.Module, layer_ids: list[int]):
        super().__init__()
        self.hf = hf_model
        self.hf.eval()
        self.hf.requires_grad_(False)
        _check_layer_ids(list(layer_ids), int(self.config.num_hidden_layers))
        self.layer_ids = list(layer_ids)
        # Name of the cache kwarg: transformers 5.x renamed `past_key_values` to `cache`.
        params = inspect.signature(self.hf.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ----------------------------------------------------------------------------------------------- sizes
    @property
    def config(self):
        """The HF config of the target."""
        return self.hf.config

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's (frozen) input embedding."""
        return self.hf.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        """The target's (frozen) LM head (may share its weight with embed_tokens)."""
        return self.hf.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module | None:
        """The target's final norm, if it exposes one as ``model.norm`` (not needed by the drafter)."""
        return getattr(getattr(self.hf, "model", None), "norm", None)

    # ------------------------------------------------------------------------------------------- forward
    def _select(self, hidden_states) -> torch.Tensor:
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Concatenated features of the configured layers for full sequences (no cache).

        Packed rows: pass ``doc_ids`` (and/or per-document ``position_ids`` restarting at 0, with no
        ``attention_mask``); HF then treats every document as its own sequence, so no document sees
        another. Without either, a row is one causal sequence.

        Args:
            input_ids: [B, S].
            attention_mask: optional [B, S] padding mask (1 = real token); not combined with packing.
            doc_ids: optional [B, S] document ids (-1 = padding) of packed rows.
            position_ids: optional [B, S] positions.

        Returns:
            [B, S, n_feat * H] in the target's dtype.

        Raises:
            ValueError: attention_mask together with packing.
        """
        if doc_ids is not None and position_ids is None:
            position_ids = positions_from_docs(doc_ids)
        if attention_mask is not None and position_ids is not None and doc_ids is not None:
            raise ValueError("give either attention_mask (padding) or doc_ids (packing), not both")
        out = self.hf(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,  # a cache disables HF's packed-sequence detection (and is not needed)
            output_hidden_states=True,
        )
        return self._select(out.hidden_states)

    def new_cache(self):
        """An empty KV cache for `logits_and_features` (an HF DynamicCache)."""
        from transformers import DynamicCache

        return DynamicCache()

    @staticmethod
    def cache_length(cache) -> int:
        return int(cache.get_seq_length()) if cache is not None else 0

    @staticmethod
    def crop_cache(cache, length: int) -> None:
        """Keep the first ``length`` positions of ``cache``.

        A negative argument to ``crop`` means "remove that many from the end" in both transformers 4.57
        and 5.x (their positive meanings differ), so only the negative form is used.
        """
        extra = int(cache.get_seq_length()) - length
        if extra > 0:
            cache.crop(-extra)

    @torch.no_grad()
    def logits_and_features(
        self,
        input_ids: torch.Tensor,
        cache=None,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of new tokens (prefill or verify), extending ``cache`` in place.

        Args:
            input_ids: [B, T] new tokens, at positions cache_length .. cache_length+T-1.
            cache: from `new_cache`, or None for a stateless forward of the whole sequence.
            position_ids: optional [B, T]; default continues from the cache length.
            attention_mask: optional 4-D [B, 1, T, cache_length + T] additive mask in the target's dtype, used
                as given (a tree verification's ancestor mask, `trainer.ddtree.verify_inputs`); None = causal.

        Returns:
            (logits [B, T, V], features [B, T, n_feat * H]).
        """
        if position_ids is None:
            start = self.cache_length(cache)
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        kwargs = {self._cache_kw: cache} if cache is not None else {}
        out = self.hf(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=cache is not None,
            output_hidden_states=True,
            **kwargs,
        )
        return out.logits, self._select(out.hidden_states)

    # ---------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        layer_ids: list[int] | None = None,
        num_features: int = 5,
        dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        attn_implementation: str | None = "sdpa",
    ) -> "TargetModel":
        """Load a local HF causal LM directory as a frozen target.

        Args:
            path: model directory (config.json + weights).
            layer_ids: z-lab layer ids; default: the reference formula for ``num_features`` (§1.3).
            num_features: features when ``layer_ids`` is None.
            dtype: weights dtype (a torch dtype or its name).
            device: where to put it (default: CPU).
            attn_implementation: HF attention implementation.

        Raises:
            ValueError: missing directory, or bad layer ids.
        """
        from transformers import AutoModelForCausalLM

        p = Path(path)
        if not (p / "config.json").exists():
            raise ValueError(f"target model {p}: no config.json there; point model.target at an HF model directory")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        hf = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, attn_implementation=attn_implementation)
        if device is not None:
            hf.to(device)
        if layer_ids is None:
            layer_ids = default_target_layer_ids(hf.config.num_hidden_layers, num_features)
        return cls(hf, layer_ids)


class TargetHead(_TargetShape, nn.Module):
    """The parts of a target a drafter rank uses: config, embedding, LM head and final norm, nothing else.

    Read selectively from the target's safetensors files (`from_pretrained`), so a drafter rank holds
    2 x vocab x hidden numbers of the target instead of all of it (Qwen3-8B: 2.5 GB instead of 16.4 GB in
    bf16). It borrows to the drafter what TargetModel does, and has no forward.

    Args:
        config: the target's HF config.
        layer_ids: the feature layers (z-lab ids), as for TargetModel.
        embed_tokens: [V, H] embedding weight.
        lm_head: [V, H] LM head weight (the same tensor as `embed_tokens` when the target ties them).
        norm: [H] final norm weight, or None when the checkpoint has none.

    Raises:
        ValueError: bad layer ids.
    """

    def __init__(self, config, layer_ids: list[int], embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 norm: torch.Tensor | None = None):
        super().__init__()
        _check_layer_ids(list(layer_ids), int(config.num_hidden_layers))
        self.config = config
        self.layer_ids = list(layer_ids)
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens, freeze=True)
        self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)  # tied: the embedding's own tensor
        self.final_norm_weight = None if norm is None else nn.Parameter(norm, requires_grad=False)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        layer_ids: list[int] | None = None,
        num_features: int = 5,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> "TargetHead":
        """Read config.json and only the embedding, LM head and final norm tensors of a local HF model.

        The tensor names come from the model class itself, built on the meta device (no memory), so any
        architecture whose checkpoint keys match its module names works; the tensors are read with
        `safetensors.safe_open` from the shard the index names (model.safetensors.index.json) or from
        model.safetensors.

        Raises:
            ValueError: no config.json, no safetensors weights, or a tensor missing from them (the message
                names the tensor and the file).
        """
        from transformers import AutoConfig

        p = Path(path)
        if not (p / "config.json").exists():
            raise ValueError(f"target model {p}: no config.json there; point model.target at an HF model directory")
        config = AutoConfig.from_pretrained(str(p))
        names = _head_tensor_names(config)
        files = _safetensors_files(p)
        embed = _read_tensor(p, files, names["embed"])
        tied = names["lm_head"] is None or bool(getattr(config, "tie_word_embeddings", False))
        head = embed if tied else _read_tensor(p, files, names["lm_head"])
        norm = _read_tensor(p, files, names["norm"]) if names["norm"] and names["norm"] in files else None
        embed = embed.to(device=device, dtype=dtype)
        head = embed if tied else head.to(device=device, dtype=dtype)
        norm = None if norm is None else norm.to(device=device, dtype=dtype)
        if layer_ids is None:
            layer_ids = default_target_layer_ids(int(config.num_hidden_layers), num_features)
        return cls(config, layer_ids, embed, head, norm)


def _head_tensor_names(config) -> dict[str, str | None]:
    """Checkpoint names of the embedding, LM head and final norm weights of `config`'s model class."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # By module, not by parameter: a tied head shares its parameter with the embedding, not its name.
    names = {id(mod): name for name, mod in model.named_modules(remove_duplicate=False)}

    def weight_of(mod) -> str | None:
        return None if mod is None or getattr(mod, "weight", None) is None else f"{names[id(mod)]}.weight"

    return {
        "embed": weight_of(model.get_input_embeddings()),
        "lm_head": weight_of(model.get_output_embeddings()),
        "norm": weight_of(getattr(getattr(model, "model", None), "norm", None)),
    }


def _safetensors_files(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file (relative to `path`) of a local HF model directory.

    Raises:
        ValueError: neither model.safetensors.index.json nor model.safetensors is there.
    """
    import json

    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if not single.exists():
        raise ValueError(
            f"target model {path}: no model.safetensors(.index.json); a drafter rank reads only the target's "
            "embedding, head and norm from safetensors files: convert the weights with save_pretrained"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: "model.safetensors" for name in f.keys()}


def _read_tensor(path: Path, files: dict[str, str], name: str) -> torch.Tensor:
    """One tensor, read alone from its safetensors file.

    Raises:
        ValueError: the weights have no tensor of that name.
    """
    from safetensors import safe_open

    if name not in files:
        raise ValueError(f"target model {path}: its safetensors files have no tensor {name!r}")
    with safe_open(str(path / files[name]), framework="pt") as f:
        return f.get_tensor(name)
