"""Read (``capture``) and write (``intervene``) named hook points of a Qwen model with ordinary forward hooks.

Both are context managers that always remove their handles, also when the with-block raises. They never ask the
model for ``output_hidden_states``: each point is read from its own module, so the last block's ``resid_post`` is
the raw block output (pre-final-norm), like Qwen-Scope's SAE site. Decoder blocks return a Tensor in transformers
5.x and a tuple in older versions; both are handled and the same structure is handed back to the model::

    with capture(model, ["resid_post.3"]) as cap:
        model(input_ids=ids, use_cache=False)
    cap["resid_post.3"]                     # [B, T, d_model]

    with intervene(model, {"resid_post.3": lambda act, ctx: act + 4.0 * direction}):
        model.generate(ids, max_new_tokens=20)   # edits the prefill and every decode step
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hooks.adapters import QwenAdapter, get_adapter
from hooks.points import HookPoint, parse_hook_name, resid_post
from hooks.positions import parse_positions, position_mask

__all__ = ["InterventionContext", "Capture", "Intervention", "capture", "capture_forward", "intervene"]

Edit = Callable[[torch.Tensor, "InterventionContext"], "torch.Tensor | None"]


@dataclass(frozen=True)
class InterventionContext:
    """What an intervention function knows about the forward pass it is editing.

    Attributes:
        point: canonical hook name, e.g. ``"resid_post.3"``.
        layer: decoder block index.
        step: forward passes of the model since the context opened (0 = first; during ``generate``, 0 is the
            prefill and k the k-th decode step).
        past_length: tokens already in the cache before this pass (0 on a prefill or a cache-less forward).
        positions: LongTensor [T], absolute positions of this pass's tokens (``past_length + arange(T)``; left
            padding is not subtracted).
    """

    point: str
    layer: int
    step: int
    past_length: int
    positions: torch.Tensor

    @property
    def is_prefill(self) -> bool:
        """True on a pass that starts the sequence (no cached tokens before it)."""
        return self.past_length == 0


class _PassTracker:
    """Counts forward passes of the text model and reads how many tokens its cache already holds."""

    def __init__(self) -> None:
        self.step = -1
        self.past_length = 0

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = None
        for key in ("cache", "past_key_values", "cache_params"):
            if kwargs.get(key) is not None:
                cache = kwargs[key]
                break
        self.step += 1
        self.past_length = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0

    def context(self, point: HookPoint, act: torch.Tensor) -> InterventionContext:
        T = act.shape[1] if act.ndim >= 3 else act.shape[0]
        positions = torch.arange(self.past_length, self.past_length + T, device=act.device)
        return InterventionContext(point.name, point.layer, max(self.step, 0), self.past_length, positions)


def _check_edit(point: HookPoint, old: torch.Tensor, new: torch.Tensor | None) -> torch.Tensor:
    if new is None:
        return old
    if not isinstance(new, torch.Tensor) or new.shape != old.shape:
        got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
        raise ValueError(f"intervention at {point.name} returned {got}; expected a Tensor of shape {tuple(old.shape)}")
    return new.to(old.dtype)


def _register(adapter: QwenAdapter, point: HookPoint, tracker: _PassTracker, edit: Edit):
    """Register one hook at ``point`` that passes (activation, context) to ``edit`` and writes back its result."""
    n = point.layer

    def on_output(module, args, output):
        act = output[0] if isinstance(output, tuple) else output
        new = _check_edit(point, act, edit(act, tracker.context(point, act)))
        if new is act:
            return None
        return (new, *output[1:]) if isinstance(output, tuple) else new

    def on_input(module, args, kwargs):
        act = args[0] if args else kwargs["hidden_states"]
        new = _check_edit(point, act, edit(act, tracker.context(point, act)))
        if new is act:
            return None
        if args:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": new}

    if point.kind == "embed":
        return adapter.embed.register_forward_hook(on_output)
    if point.kind == "resid_post":
        return adapter.layers[n].register_forward_hook(on_output)
    if point.kind == "attn_out":
        return adapter.mixer(n).register_forward_hook(on_output)
    if point.kind == "mlp_out":
        return adapter.mlp(n).register_forward_hook(on_output)
    if point.kind == "resid_pre":
        return adapter.layers[n].register_forward_pre_hook(on_input, with_kwargs=True)
    if point.kind == "resid_mid":
        return adapter.post_attention_norm(n).register_forward_pre_hook(on_input, with_kwargs=True)
    if point.kind == "mlp_post":
        return _part(adapter, point, "mlp", "down_proj").register_forward_pre_hook(on_input, with_kwargs=True)
    return _register_internal(adapter, point, tracker, edit)


def _part(adapter: QwenAdapter, point: HookPoint, where: str, attr: str) -> nn.Module:
    """The submodule ``attr`` of block ``point.layer``'s mixer or MLP, or a ValueError saying where the point exists."""
    n = point.layer
    owner = adapter.mlp(n) if where == "mlp" else adapter.mixer(n)
    module = getattr(owner, attr, None)
    if isinstance(module, nn.Module):
        return module
    if where == "mlp":
        raise ValueError(f"{point.name} needs a dense MLP (with down_proj); block {n} has {type(owner).__name__}")
    wanted = "full_attention" if point.kind.startswith("attn_") else "linear_attention"
    layers = [i for i, t in enumerate(adapter.layer_types) if t == wanted]
    if adapter.layer_types[n] == wanted:
        raise ValueError(f"{point.name}: {type(owner).__name__} of block {n} has no {attr} module, so {point.kind} "
                         f"cannot be read in the {adapter.family} family")
    raise ValueError(f"{point.name}: block {n} is a {adapter.layer_types[n]} layer ({type(owner).__name__} has no "
                     f"{attr}); {point.kind} exists on the {wanted} layers {layers or 'of other families'}")


def _register_internal(adapter: QwenAdapter, point: HookPoint, tracker: _PassTracker, edit: Edit):
    """Capture-only points inside the attention or GDN mixer: the value is formed from what that module computes."""
    mixer = adapter.mixer(point.layer)

    def read(value: torch.Tensor) -> None:
        edit(value, tracker.context(point, value))

    if point.kind in ("attn_q", "attn_k", "attn_v"):
        proj = _part(adapter, point, "attn", f"{point.kind[-1]}_proj")
        head_dim = int(mixer.head_dim)

        def on_projection(module, args, out):
            heads = out.view(*out.shape[:-1], -1, head_dim)  # [B, T, H(*2), head_dim]
            if point.kind == "attn_q" and out.shape[-1] == 2 * adapter.config.num_attention_heads * head_dim:
                # Qwen3.5's q_proj holds query and output gate per head: the query is the first half.
                heads = out.view(*out.shape[:-1], -1, 2 * head_dim)[..., :head_dim]
            read(heads)
        return proj.register_forward_hook(on_projection)
    if point.kind == "attn_z":
        _part(adapter, point, "attn", "o_proj")
        head_dim = int(mixer.head_dim)

        def on_z(module, args):
            read(args[0].view(*args[0].shape[:-1], -1, head_dim))
        return mixer.o_proj.register_forward_pre_hook(on_z)
    if point.kind == "attn_pattern":
        _part(adapter, point, "attn", "q_proj")
        impl = getattr(adapter.config, "_attn_implementation", None)
        if impl != "eager":
            raise ValueError(f"{point.name} needs eager attention ({impl!r} never forms the softmax weights): load "
                             f"with attn_implementation='eager' or call model.set_attn_implementation('eager')")

        def on_pattern(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise ValueError(f"{point.name}: the attention returned no weights; use attn_implementation='eager'")
            read(weights.transpose(1, 2))  # [B, H, T, T_k] -> [B, T, H, T_k]
        return mixer.register_forward_hook(on_pattern)
    if point.kind in ("gdn_beta", "gdn_decay"):
        proj = _part(adapter, point, "gdn", "in_proj_b" if point.kind == "gdn_beta" else "in_proj_a")

        def on_gate(module, args, out):
            if point.kind == "gdn_beta":
                read(out.sigmoid())
            else:
                read(-mixer.A_log.float().exp() * nn.functional.softplus(out.float() + mixer.dt_bias))
        return proj.register_forward_hook(on_gate)
    if point.kind == "gdn_core":
        norm = _part(adapter, point, "gdn", "norm")
        shape: list[int] = []

        def on_mixer(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            shape[:] = hidden.shape[:2]

        def on_core(module, args):
            # The norm sees [B*T*Hv, Dv]; the mixer's input gives back B and T.
            read(args[0].view(shape[0], shape[1], int(mixer.num_v_heads), -1))
        return _Handles(mixer.register_forward_pre_hook(on_mixer, with_kwargs=True),
                        norm.register_forward_pre_hook(on_core))
    raise AssertionError(f"unhandled hook kind {point.kind}")


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def _hooked(model: nn.Module | QwenAdapter, edits: Sequence[tuple[HookPoint, Edit]]) -> Iterator[None]:
    adapter = get_adapter(model)
    tracker = _PassTracker()
    handles = []
    try:
        handles.append(adapter.text_model.register_forward_pre_hook(tracker.pre_hook, with_kwargs=True))
        for point, edit in edits:
            handles.append(_register(adapter, point, tracker, edit))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class Capture(Mapping):
    """Activations recorded by ``capture``, keyed by canonical hook name (any alias works for lookup).

    ``cap[name]`` is a Tensor [B, T, d_model]: one forward pass as is, or the passes of one ``generate`` call
    (prefill then decode steps) concatenated along T in position order. ``cap.calls(name)`` gives each pass
    separately and ``cap.positions(name)`` the absolute positions [T] that were kept.
    """

    n_layers: int
    _calls: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _positions: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def _key(self, name: str) -> str:
        return parse_hook_name(name, self.n_layers).name

    def _recorded(self, name: str) -> str:
        """The canonical key of ``name``; KeyError naming the requested points when nothing was recorded there."""
        key = self._key(name)
        if key not in self._calls or not self._calls[key]:
            raise KeyError(f"nothing captured at {key}: was it requested (this capture has {sorted(self._calls)}), and "
                           "did the model run inside the with-block?")
        return key

    def calls(self, name: str) -> list[torch.Tensor]:
        """One Tensor [B, T_i, d_model] per forward pass, in order (empty if the model did not run)."""
        key = self._key(name)
        if key not in self._calls:
            self._recorded(name)  # raises, naming the points this capture records
        return list(self._calls[key])

    def positions(self, name: str) -> torch.Tensor:
        """LongTensor [T]: the absolute positions of the tokens in ``self[name]``."""
        return torch.cat(self._positions[self._recorded(name)])

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self._recorded(name)
        calls = self._calls[key]
        if len(calls) == 1:
            return calls[0]
        starts = [int(p[0]) for p in self._positions[key] if p.numel()]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"{key} was captured in {len(calls)} separate forward passes (not one generate call); "
                             f"use cap.calls({key!r}) to get them one by one")
        return torch.cat(calls, dim=1)

    def __iter__(self):
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)


@contextlib.contextmanager
def capture(model: nn.Module, points: str | Sequence[str], positions: None | int | str | Sequence[int] = None,
            dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Iterator[Capture]:
    """Record activations at named hook points during any forward passes run inside the with-block.

    Args:
        model: a supported Qwen model (see ``get_adapter``).
        points: hook names in any accepted spelling, e.g. ``["resid_post.3", "blocks.5.hook_resid_post"]``.
        positions: tokens to keep: None (all), absolute positions (int, list, or a spec like ``"0,2,5-8"``);
            negative entries count from the end of each pass (``-1`` keeps each pass's last token).
        dtype, device: where the recorded copies go (default: as produced).

    Returns:
        a ``Capture`` mapping canonical names to Tensors [B, T_kept, d_model] (filled as the model runs).

    Example:
        >>> with capture(model, ["resid_post.11"], dtype=torch.float32, device="cpu") as cap:
        ...     model(input_ids=ids, use_cache=False)
        >>> cap["resid_post.11"].shape        # [B, T, d_model]
    """
    adapter = get_adapter(model)
    names = [points] if isinstance(points, (str, HookPoint)) else list(points)
    parsed = list(dict.fromkeys(parse_hook_name(p, adapter.n_layers) for p in names))
    selection = parse_positions(positions)
    cap = Capture(adapter.n_layers)

    def recorder(point: HookPoint) -> Edit:
        cap._calls[point.name] = []
        cap._positions[point.name] = []

        def record(act: torch.Tensor, ctx: InterventionContext) -> None:
            # Positions and the kept set are worked out on the host (they depend only on past_length and T): a
            # boolean mask on the GPU would make every recorded point wait for the forward (nonzero + .cpu()),
            # and the host would then stall the device while it launches the rest of the step.
            where = torch.arange(ctx.past_length, ctx.past_length + ctx.positions.shape[0])
            kept = act.detach()
            if selection is not None:
                index = position_mask(selection, where).nonzero().squeeze(1)
                where = where[index]
                kept = kept.index_select(1, index.to(act.device, non_blocking=True))
            copy = kept.to(device=device, dtype=dtype)
            # A later in-place edit must not change what was recorded.
            if copy.data_ptr() == act.data_ptr():
                copy = copy.clone()
            cap._calls[point.name].append(copy)
            cap._positions[point.name].append(where)
            return None
        return record

    with _hooked(adapter, [(p, recorder(p)) for p in parsed]):
        yield cap


@dataclass
class Intervention:
    """Handle yielded by ``intervene``: ``fired[name]`` counts the passes each point was edited in."""

    fired: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def intervene(model: nn.Module, edits: Mapping[str, Edit | Sequence[Edit]]) -> Iterator[Intervention]:
    """Edit activations at named hook points during any forward passes (prefill and decode) inside the with-block.

    Args:
        model: a supported Qwen model.
        edits: ``{hook_name: fn}`` (or a list of fns, applied in order) where ``fn(act, ctx)`` receives the
            activation [B, T, d_model] and an ``InterventionContext`` and returns the new activation (same shape),
            or None to keep it (in-place edits then stand).

    Returns:
        an ``Intervention`` whose ``fired`` dict counts, per canonical name, the passes that were edited.

    Raises:
        ValueError: for an unknown or capture-only point (``resid_mid``).

    Example:
        >>> v = sae.W_dec[:, 123]
        >>> with intervene(model, {"resid_post.12": lambda act, ctx: act + 8.0 * v}):
        ...     out = model.generate(ids, max_new_tokens=30, do_sample=False)
    """
    adapter = get_adapter(model)
    handle = Intervention()
    pairs: list[tuple[HookPoint, Edit]] = []
    for name, fns in edits.items():
        point = parse_hook_name(name, adapter.n_layers)
        if not point.writable:
            why = ("editing the norm input would not change the residual" if point.kind == "resid_mid"
                   else "it is read from inside the mixer, where a write would not reach the computation")
            raise ValueError(f"{point.name} is capture-only ({why}); edit {HookPoint('attn_out', point.layer)}, "
                             f"{HookPoint('mlp_post', point.layer)} or {resid_post(point.layer)} instead")
        for j, fn in enumerate([fns] if callable(fns) else list(fns)):
            pairs.append((point, _counted(fn, point.name, handle) if j == 0 else fn))
    with _hooked(adapter, pairs):
        yield handle


def _counted(fn: Edit, name: str, handle: Intervention) -> Edit:
    def wrapped(act: torch.Tensor, ctx: InterventionContext):
        handle.fired[name] = handle.fired.get(name, 0) + 1
        return fn(act, ctx)
    return wrapped


class _StopForward(Exception):
    """Raised by ``capture_forward`` after the deepest requested point so later blocks are not computed."""


def capture_forward(model: nn.Module, points: str | Sequence[str], *, stop_early: bool = True,
                    positions: None | int | str | Sequence[int] = None, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, **forward_kwargs) -> Capture:
    """Run one cache-less, gradient-free forward pass and return the activations at ``points``: ``capture`` around
    one forward. (The corpus-scale collection into a store is ``qwen_scope.collect``.)

    Args:
        model: a supported Qwen model.
        points: hook names (any accepted spelling).
        stop_early: stop after the deepest requested block (no later blocks, no lm_head).
        positions, dtype, device: as for ``capture``.
        **forward_kwargs: model inputs, e.g. ``input_ids`` [B, T] and ``attention_mask`` [B, T] (``use_cache`` is
            always False).

    Returns:
        a ``Capture`` (``cap[name]`` is [B, T_kept, d_model]).

    Example:
        >>> cap = capture_forward(model, ["resid_post.12"], input_ids=ids)   # blocks 13.. never run
    """
    adapter = get_adapter(model)
    names = [points] if isinstance(points, (str, HookPoint)) else list(points)
    deepest = max(parse_hook_name(p, adapter.n_layers).layer for p in names)

    def stop(module, args, output):
        raise _StopForward

    with torch.no_grad(), capture(adapter.model, names, positions=positions, dtype=dtype, device=device) as cap:
        handle = adapter.layers[deepest].register_forward_hook(stop) if stop_early else None
        try:
            # Always cache-less; a use_cache= the caller passes along with the inputs must not clash with it.
            adapter.model(**{**forward_kwargs, "use_cache": False})
        except _StopForward:
            pass
        finally:
            if handle is not None:
                handle.remove()
    return cap
