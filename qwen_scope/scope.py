"""``Scope``: a Qwen model, its tokenizer and Qwen-Scope SAEs at chosen layers — the object every verb works on.

    scope = Scope.from_pretrained("Qwen/Qwen3.5-2B-Base", "qwen-scope-3.5-2b-base-w32k-l50", layers=[12])
    scope.features("The Eiffel Tower is in Paris").top(12)
    scope.steer("Once upon a time", [add(12, 4242, 20.0)]).side_by_side()

An SAE of layer n reads ``resid_post.n``: the output of decoder block n.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from hooks import QwenAdapter, get_adapter, resid_post
from saes import Release, TopKSAE, check_d_model, get_release, load

__all__ = ["Scope"]

logger = logging.getLogger(__name__)


def _model_name(model: nn.Module) -> str | None:
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else None


class Scope:
    """A Qwen model + tokenizer + SAEs (one per chosen layer), checked to fit each other.

    Args:
        model: a loaded Qwen causal LM of a supported family (see ``hooks.get_adapter``).
        tokenizer: its tokenizer (anything callable like a transformers tokenizer).
        saes: ``{layer: TopKSAE}``; more can be added with ``add_sae`` / ``load_saes``.
        release: the Release the SAEs come from, for provenance and the base-vs-instruct check.
        model_name: the model's hub id or path, for messages and the check (default: ``model.name_or_path``).

    Raises:
        ValueError: an SAE's d_model differs from the model's hidden size, or its layer is out of range.

    Example:
        >>> scope = Scope(model, tokenizer, {12: sae})
        >>> scope.layers
        [12]
    """

    def __init__(self, model: nn.Module, tokenizer, saes: Mapping[int, TopKSAE] | None = None, *,
                 release: Release | str | None = None, model_name: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.adapter: QwenAdapter = get_adapter(model)
        self.model_name = model_name or _model_name(model)
        self.release = get_release(release) if isinstance(release, str) else release
        self.saes: dict[int, TopKSAE] = {}
        if self.release is not None:
            self._check_release(self.release)
        for layer, sae in (saes or {}).items():
            self.add_sae(layer, sae)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_id: str | Path, release: str | Path | None = None,
                        layers: int | Iterable[int] | None = None, *, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, sae_dtype: torch.dtype | None = None,
                        tokenizer: object | None = None, revision: str | None = None,
                        cache_dir: str | Path | None = None, **model_kwargs) -> Scope:
        """Load a model (hub id or local dir), its tokenizer and the SAEs of ``release`` at ``layers``.

        Args:
            model_id: e.g. ``"Qwen/Qwen3.5-2B-Base"`` or a local directory saved with ``save_pretrained``.
            release: sae-lens release id, HF repo id or local release directory (``layer{n}.sae.pt`` inside).
            layers: SAE layers to load (default: none; an int for one).
            device: where model and SAEs go (default CPU; ``"cuda"`` for a GPU).
            dtype: model dtype (default bfloat16 on CUDA, float32 on CPU).
            sae_dtype: SAE weight dtype (default: the model's dtype).
            tokenizer: an already-loaded tokenizer (default: ``AutoTokenizer.from_pretrained(model_id)``).
            revision, cache_dir: hub revision and cache for the model and the SAEs.
            **model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

        Returns:
            a ``Scope`` in eval mode.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from qwen_scope.sources import check_device, model_config, quiet_reference_kernel_advice

        if layers is not None and release is None:
            raise ValueError(f"layers={layers!r} given without a release; pass release= (an SAE release id, hub "
                             "repo or local directory) to load SAEs at those layers")
        device = check_device(device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        # Config, layer range and SAE files before the model's weights: a missing model or SAE file, a bad layer or
        # a release for another model is reported in a second, with its fix, not after a multi-GB load.
        config = model_config(model_id, revision=revision, cache_dir=cache_dir).get_text_config()
        rel = None
        if release is not None and not Path(str(release)).expanduser().exists():
            rel = get_release(str(release))
            _check_release_fits(rel, int(config.hidden_size), str(model_id))
        early = {}
        if release is not None and layers is not None:
            n_layers = int(config.num_hidden_layers)
            for layer in [layers] if isinstance(layers, int) else list(layers):
                _check_layer_index(layer, n_layers, str(model_id), f"{release} layer {layer}")
                early[layer] = load(release, layer, device=device, dtype=sae_dtype or dtype, cache_dir=cache_dir)
        quiet_reference_kernel_advice()
        logger.info("loading %s (%s on %s) with SAEs at layers %s", model_id, dtype, device, sorted(early))
        model = AutoModelForCausalLM.from_pretrained(str(model_id), dtype=dtype, revision=revision,
                                                     cache_dir=cache_dir, **model_kwargs).to(device).eval()
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(model_id), revision=revision, cache_dir=cache_dir)
        scope = cls(model, tokenizer, release=rel, model_name=str(model_id))
        for layer, sae in early.items():
            scope.add_sae(layer, sae)
        return scope

    def load_saes(self, release: str | Path, layers: int | Iterable[int], *, dtype: torch.dtype | None = None,
                  cache_dir: str | Path | None = None, k: int | None = None) -> dict[int, TopKSAE]:
        """Load the SAEs of ``release`` at ``layers`` onto the model's device and attach them; return them.

        ``k`` is needed only for a local directory whose name does not carry ``L0_<k>``.
        """
        layer_list = [layers] if isinstance(layers, int) else list(layers)
        loaded = {}
        for layer in layer_list:
            self._check_layer(layer, f"{release} layer {layer}")
            sae = load(release, layer, device=self.device, dtype=dtype or self.dtype, cache_dir=cache_dir, k=k)
            loaded[layer] = self.add_sae(layer, sae)
        return loaded

    def add_sae(self, layer: int, sae: TopKSAE) -> TopKSAE:
        """Attach ``sae`` at ``layer`` (reading ``resid_post.<layer>``) after checking that it fits the model."""
        layer = self._check_layer(layer, f"SAE for layer {layer}")
        check_d_model(sae, self.adapter.d_model, self.model_name)
        rel = getattr(sae, "release", None)
        if rel is not None and (self.release is None or rel.id != self.release.id):
            self._check_release(rel)
            self.release = self.release or rel
        self.saes[layer] = sae
        return sae

    def _check_layer(self, layer: int, what: str) -> int:
        return _check_layer_index(layer, self.adapter.n_layers, self.model_name, what)

    def _check_release(self, release: Release) -> None:
        _check_release_fits(release, self.adapter.d_model, self.model_name)
        if release.n_layers is not None and release.n_layers != self.adapter.n_layers:
            warnings.warn(f"{release.id} covers {release.n_layers} layers ({release.model_id}) but "
                          f"{self.model_name or 'this model'} has {self.adapter.n_layers}: is it the right model?",
                          UserWarning, stacklevel=3)
        mismatch = release.model_mismatch(self.model_name) if self.model_name else None
        if mismatch:
            warnings.warn(mismatch, UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ accessors
    @property
    def layers(self) -> list[int]:
        """Layers that have an SAE attached, sorted."""
        return sorted(self.saes)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def pad_id(self) -> int:
        """The token id batches are padded with: the tokenizer's pad token, else its eos token, else 0."""
        tok = self.tokenizer
        pad = getattr(tok, "pad_token_id", None)
        pad = pad if pad is not None else getattr(tok, "eos_token_id", None)
        return int(pad) if pad is not None else 0

    def sae(self, layer: int) -> TopKSAE:
        """The SAE at ``layer``; ``KeyError`` names the loaded layers."""
        if layer not in self.saes:
            n = self.adapter.n_layers
            fix = (f"Load it with scope.load_saes(release, [{layer}])" if isinstance(layer, int) and 0 <= layer < n
                   else f"{self.model_name or 'the model'} has decoder blocks 0..{n - 1} only")
            raise KeyError(f"no SAE at layer {layer}; loaded layers are {self.layers}. {fix}")
        return self.saes[layer]

    def hook_name(self, layer: int) -> str:
        """Canonical hook point an SAE of ``layer`` reads: ``hooks.resid_post(layer)``, e.g. ``"resid_post.12"``."""
        return resid_post(layer)

    def tokenize(self, text: str, template: str | None = None) -> torch.Tensor:
        """Token ids [1, T] of ``text`` on the model's device.

        Args:
            text: the text.
            template: None (raw text), ``"chat"`` (chat template with a generation prompt), ``"chat-think"``
                (opens ``<think>``) or ``"chat-nothink"`` (an empty think block, as Qwen's demo does).
        """
        if template is not None:
            text = self.format_chat(text, template)
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=template is None)["input_ids"]
        if ids.shape[1] == 0:
            raise ValueError(f"{text!r} tokenizes to no tokens")
        return ids.to(self.device)

    def format_chat(self, text: str, template: str) -> str:
        """Wrap ``text`` as one user turn with the tokenizer's chat template (see ``tokenize``)."""
        if template not in ("chat", "chat-think", "chat-nothink"):
            raise ValueError(f"template must be None, 'chat', 'chat-think' or 'chat-nothink', got {template!r}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model_name or 'this model'} has no chat template; "
                             "use template=None for raw text")
        prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
        if template == "chat-think":
            prompt += "<think>\n"
        elif template == "chat-nothink":
            prompt += "<think>\n\n</think>\n\n"
        return prompt

    def decode_tokens(self, ids: torch.Tensor | Iterable[int]) -> list[str]:
        """One display string per token id (bytes of partial characters become U+FFFD)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return [self.tokenizer.decode([i]) for i in ids]

    # ------------------------------------------------------------------ verbs (thin forwards to their modules)
    def features(self, text: str, layers: int | Iterable[int] | None = None, **kwargs):
        """SAE features of ``text``; see ``qwen_scope.features.text_features``."""
        from qwen_scope.features import text_features

        return text_features(self, text, layers, **kwargs)

    def steer(self, prompt: str, edits, *, evaluate: bool = False, **kwargs):
        """Baseline vs steered generation; see ``qwen_scope.steering.steer``.

        ``evaluate=True`` also measures the edit (KL per step, the feature's activation, perplexity, top logit
        deltas) against random-direction and random-feature controls and returns a ``SteeringEvaluation`` (its
        ``.result`` is the ``SteeringResult``); see ``qwen_scope.evals.evaluate_steering`` for the keywords.
        """
        if evaluate:
            from qwen_scope.evals import evaluate_steering

            return evaluate_steering(self, prompt, edits, **kwargs)
        from qwen_scope.steering import steer

        return steer(self, prompt, edits, **kwargs)

    def generate(self, prompts, edits=(), **kwargs):
        """Generations of one prompt or a batch, steered by ``edits`` (none: plain), on the static decode engine
        where it applies; see ``qwen_scope.engine.batches.generate``."""
        from qwen_scope.engine.batches import generate

        return generate(self, prompts, edits, **kwargs)

    def compare(self, text_a, text_b, layers: int | Iterable[int] | None = None, **kwargs):
        """Features ranked by activation-rate difference; see ``qwen_scope.compare.compare``."""
        from qwen_scope.compare import compare

        return compare(self, text_a, text_b, layers, **kwargs)

    def explore(self, text: str, *, db=None, layer: int | None = None, widget: bool | None = None):
        """The explorer's views of ``text`` in a notebook: an ipywidgets widget (token → its features → the card,
        steering sliders) where ipywidgets imports, else the static HTML; see ``qwen_scope.app.jupyter.explore``."""
        from qwen_scope.app.jupyter import explore

        return explore(self, text, db=db, layer=layer, widget=widget)

    def __repr__(self) -> str:
        rel = self.release.id if self.release is not None else None
        return (f"Scope(model={self.model_name!r}, family={self.adapter.family!r}, n_layers={self.adapter.n_layers}, "
                f"d_model={self.adapter.d_model}, release={rel!r}, sae_layers={self.layers})")


def _check_layer_index(layer: int, n_layers: int, model_name: str | None, what: str) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise ValueError(f"{what}: layer must be an int in 0..{n_layers - 1} ({model_name or 'the model'} has "
                         f"{n_layers} decoder blocks), got {layer!r}")
    return layer


def _check_release_fits(release: Release, d_model: int, model_name: str | None) -> None:
    if release.d_model is not None and release.d_model != d_model:
        raise ValueError(f"{release.id} was trained on {release.model_id} with d_model {release.d_model}, but "
                         f"{model_name or 'this model'} has hidden size {d_model}; "
                         f"pick a release for this model (saes.list_releases())")
