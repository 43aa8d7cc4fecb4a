"""``DecodeEngine``: batched, steered generation on static buffers, one decode step replayed per token.

    engine = DecodeEngine(scope.model, scope.saes)
    result = engine.generate([ids_a, ids_b], edits=[[add(12, 4242, 20.0)], []], max_new_tokens=64)
    result.rows[0].token_ids, result.rows[0].probs, result.nbytes

The flow: size the state and refuse a batch that cannot fit (``state.check_fits``), allocate it once, prefill with
the model's own forward (``prefill.py``), then decode: on CUDA the first step runs eagerly on a side stream (the
graph's warm-up, and a real step), the second is captured as a ``torch.cuda.CUDAGraph`` and every later token is a
replay; on CPU every step runs eagerly. The host looks at the device only to stream tokens (when asked) and, every
``sync_every`` steps, to stop once every row has finished. A second request with the same shapes and steering
structure reuses the buffers and the captured graph: new strengths, features or prompts are new buffer contents.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hooks import QwenAdapter, get_adapter, resid_post
from qwen_scope.engine.prefill import prefill
from qwen_scope.engine.sampling import SamplingBuffers, SamplingConfig
from qwen_scope.engine.state import DecodeState, StateLayout, check_fits
from qwen_scope.engine.steer_buffers import LayerSteerBuffers, build_steer_buffers, structure_of
from qwen_scope.engine.step import DecodeStep, unsupported_reason
from qwen_scope.steering import FeatureEdit, _group_edits
from saes import SparseCodes, TopKSAE

__all__ = ["DecodeEngine", "EngineRow", "EngineResult"]


@dataclass(frozen=True)
class EngineRow:
    """One row's generation.

    Attributes:
        prompt_ids: [P] the prompt. token_ids: [G_b] new tokens (through the stop token, if one came).
        probs: [G_b] probability of each chosen token under the raw logits. top_ids / top_probs: [G_b, top_n].
        logits: [G_b, V] float32 raw logits per step (when ``keep_logits``), else None.
        readout: ``{layer: SparseCodes}`` with values / indices [G_b, k]: the SAE codes of ``resid_post.<layer>``
            at each generated token's position.
    """

    prompt_ids: torch.Tensor
    token_ids: torch.Tensor
    probs: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    logits: torch.Tensor | None = None
    readout: dict[int, SparseCodes] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineResult:
    """Every row of one batched generation, with what it cost.

    Attributes:
        rows: one ``EngineRow`` per request row, in order. nbytes: preallocated bytes of the batch's state.
        steps: decode steps run after the prefill. graph: whether the steps replayed a captured CUDA graph.
        fired: passes steered per hook point (the prefill plus every decode step), as ``Scope.steer`` counts them.
    """

    rows: tuple[EngineRow, ...]
    nbytes: int
    steps: int
    graph: bool
    fired: dict[str, int]


@dataclass
class _Session:
    key: tuple
    state: DecodeState
    steer: dict[int, LayerSteerBuffers]
    sampling: SamplingBuffers | None
    step: DecodeStep
    graph: object = None


class DecodeEngine:
    """Batched steered generation for a Qwen3 / Qwen3.5 / Qwen3-Next (dense or MoE) causal LM.

    Args:
        model: the causal LM (or its adapter).
        saes: ``{layer: TopKSAE}`` for steering edits and readout.
        use_graph: capture the decode step as a CUDA graph (default: on CUDA devices).
        sync_every: decode steps between the host's checks whether every row has finished.

    Raises:
        ValueError: for a model whose layers have no decode form here (``DecodeEngine.unsupported_reason``).
    """

    def __init__(self, model: nn.Module | QwenAdapter, saes: Mapping[int, TopKSAE] | None = None, *,
                 use_graph: bool | None = None, sync_every: int = 16):
        self.adapter = get_adapter(model)
        reason = unsupported_reason(self.adapter)
        if reason:
            raise ValueError(f"the decode engine cannot run {type(self.adapter.model).__name__}: {reason}; "
                             "use model.generate (Scope.steer falls back to it by itself)")
        self.saes = dict(saes or {})
        self.device = next(self.adapter.model.parameters()).device
        self.use_graph = self.device.type == "cuda" if use_graph is None else bool(use_graph)
        if self.use_graph and self.device.type != "cuda":
            raise ValueError(f"use_graph=True needs a CUDA model; this one is on {self.device}")
        self.sync_every = max(1, int(sync_every))
        self._session: _Session | None = None

    @staticmethod
    def unsupported_reason(model: nn.Module) -> str | None:
        """Why ``model`` cannot run on the engine (one line), or None."""
        try:
            adapter = get_adapter(model)
        except TypeError as err:
            return str(err).split(". ")[0]
        return unsupported_reason(adapter)

    # ------------------------------------------------------------------ request -> session
    def _session_for(self, prompts, edit_rows, G, sampling, top_n, readout, keep_logits, stop_ids, pad_id):
        B = len(prompts)
        S = max(int(p.shape[-1]) for p in prompts) + G
        readout_k = {n: (self.saes[n].k if k is None else int(k)) for n, k in readout.items()}
        key = (B, S, G, top_n, structure_of(edit_rows), sampling.do_sample, tuple(sorted(readout_k.items())),
               keep_logits, tuple(stop_ids), pad_id)
        lengths = [int(p.shape[-1]) for p in prompts]
        session = self._session
        if session is None or session.key != key:
            self._session = None  # the old buffers go before the new ones are sized against free memory
            layout = StateLayout.of(self.adapter, B, S, G, top_n=top_n, readout_k=readout_k, keep_logits=keep_logits)
            check_fits(layout, self.device)
            state = DecodeState(layout, self.device, pad_id=pad_id, stop_ids=stop_ids)
            steer = build_steer_buffers(edit_rows, self.saes, lengths, S, self.adapter.d_model, self.device)
            buffers = SamplingBuffers(sampling, B, layout.V, self.device) if sampling.do_sample else None
            read = {n: (self.saes[n], k) for n, k in readout_k.items()}
            session = _Session(key, state, steer, buffers, DecodeStep(self.adapter, state, steer, read, buffers))
            self._session = session
            return session
        _reset(session.state)
        for buf in session.steer.values():
            buf.write(edit_rows, lengths)
        if session.sampling is not None:
            session.sampling.fill(sampling)
        return session

    def _check(self, prompts, edits, readout) -> tuple[list[torch.Tensor], list[tuple[FeatureEdit, ...]]]:
        if not prompts:
            raise ValueError("prompts is empty; pass one [P] tensor of token ids per row")
        rows = []
        for b, p in enumerate(prompts):
            p = torch.as_tensor(p)
            if p.dim() == 2 and p.shape[0] == 1:
                p = p[0]
            if p.dim() != 1 or p.numel() == 0 or p.is_floating_point():
                raise ValueError(f"prompt {b} must be a non-empty [P] tensor of token ids, got shape "
                                 f"{tuple(p.shape)} ({p.dtype})")
            rows.append(p.long())
        edit_rows = [()] * len(rows) if edits is None else [tuple(e) for e in edits]
        if len(edit_rows) != len(rows):
            raise ValueError(f"edits has {len(edit_rows)} rows but there are {len(rows)} prompts; pass one list "
                             "of edits per prompt (an empty list for an unsteered row)")
        for row in edit_rows:
            _group_edits(self.saes, row)
        missing = [n for n in readout if n not in self.saes]
        if missing:
            raise KeyError(f"readout layers {missing} have no SAE; SAEs are loaded at layers {sorted(self.saes)}")
        return rows, edit_rows

    # ------------------------------------------------------------------ generation
    def stream(self, prompts: Sequence[torch.Tensor], edits: Sequence[Sequence[FeatureEdit]] | None = None, *,
               max_new_tokens: int = 40, sampling: SamplingConfig | None = None,
               stop_tokens: Sequence[int] | None = None, pad_id: int = 0, top_n: int = 5,
               readout: Mapping[int, int | None] | Sequence[int] = (), keep_logits: bool = False,
               max_new_per_row: Sequence[int] | None = None) -> Iterator[torch.Tensor]:
        """Generate, yielding each step's [B] new tokens on the CPU as they come (finished rows yield the pad id).

        Same arguments as ``generate``; the final ``EngineResult`` is the generator's return value (and
        ``self.last_result``).
        """
        return self._run(prompts, edits, max_new_tokens, sampling, stop_tokens, pad_id, top_n, readout,
                         keep_logits, max_new_per_row, stream=True)

    def generate(self, prompts: Sequence[torch.Tensor], edits: Sequence[Sequence[FeatureEdit]] | None = None, *,
                 max_new_tokens: int = 40, sampling: SamplingConfig | None = None,
                 stop_tokens: Sequence[int] | None = None, pad_id: int = 0, top_n: int = 5,
                 readout: Mapping[int, int | None] | Sequence[int] = (), keep_logits: bool = False,
                 max_new_per_row: Sequence[int] | None = None,
                 on_token: Callable[[torch.Tensor], None] | None = None) -> EngineResult:
        """Generate up to ``max_new_tokens`` for every prompt, each row with its own edits.

        Args:
            prompts: one [P_b] int64 tensor per row (lengths may differ).
            edits: one list of ``FeatureEdit`` per row (default: none); positions count from each row's start.
            max_new_tokens: columns of the batch (G). max_new_per_row: a smaller budget per row.
            sampling: ``SamplingConfig`` (default greedy).
            stop_tokens: ids that end a row (kept as its last token); default the model's generation config eos.
            pad_id: what finished rows emit. top_n: candidates kept per step.
            readout: layers (or ``{layer: k}``) whose SAE codes are kept for every generated token.
            keep_logits: also keep the [G, V] float32 raw logits of every row.
            on_token: called with each step's [B] new tokens on the CPU (a host sync per step).

        Returns:
            ``EngineResult``.
        """
        it = self._run(prompts, edits, max_new_tokens, sampling, stop_tokens, pad_id, top_n, readout,
                       keep_logits, max_new_per_row, stream=on_token is not None)
        while True:
            try:
                tokens = next(it)
            except StopIteration as done:
                return done.value
            on_token(tokens)

    def _run(self, prompts, edits, G, sampling, stop_tokens, pad_id, top_n, readout, keep_logits, per_row, *,
             stream: bool):
        if not isinstance(G, int) or G < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {G!r}")
        readout = dict(readout) if isinstance(readout, Mapping) else dict.fromkeys(readout)
        prompts, edit_rows = self._check(prompts, edits, readout)
        sampling = sampling or SamplingConfig()
        if stop_tokens is None:
            eos = getattr(getattr(self.adapter.model, "generation_config", None), "eos_token_id", None)
            stop_tokens = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        session = self._session_for(prompts, edit_rows, G, sampling, top_n, readout, keep_logits,
                                    [int(t) for t in stop_tokens], int(pad_id))
        st = session.state
        if per_row is not None:
            st.max_new.copy_(torch.as_tensor([min(int(n), G) for n in per_row], device=self.device))
        prefill(self.adapter, prompts, st, session.steer, session.sampling)
        if stream:
            yield st.last_tokens.to("cpu", copy=True)
        steps, n_steps = 0, G - 1 + (1 if readout else 0)
        while steps < n_steps:
            if steps % self.sync_every == 0 and bool(st.finished.all()):
                # one more step still reads out the rows' last tokens; without a readout nothing is left to do
                if not readout or steps == n_steps - 1:
                    break
                n_steps = steps + 1
            self._advance(session)
            steps += 1
            if stream and steps <= G - 1:
                yield st.last_tokens.to("cpu", copy=True)
        layers = [resid_post(n) for n in session.steer]
        result = EngineResult(_rows(st, prompts, readout), st.layout.nbytes(), steps, session.graph is not None,
                              dict.fromkeys(layers, 1 + min(steps, G - 1)))
        self.last_result = result
        return result

    def _advance(self, session: _Session) -> None:
        if not self.use_graph:
            session.step()
            return
        if session.graph is not None:
            session.graph.replay()
            return
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            session.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if session.sampling is not None:
            graph.register_generator_state(session.sampling.generator)
        # Capture records the step without running it: the warm-up above was this token's real step.
        with torch.cuda.graph(graph):
            session.step()
        session.graph = graph


def _reset(state: DecodeState) -> None:
    for value in vars(state).values():
        for t in (value.values() if isinstance(value, dict) else [value]):
            if isinstance(t, torch.Tensor) and t is not state.slots and t is not state.pad and t is not state.stop_ids:
                t.zero_()
    state.tokens.copy_(state.pad[:, None].expand_as(state.tokens))
    state.max_new.fill_(state.layout.G)


def _rows(state: DecodeState, prompts, readout) -> tuple[EngineRow, ...]:
    lengths = state.lengths.cpu().tolist()
    tokens, probs = state.tokens.cpu(), state.probs.cpu()
    top_ids, top_probs = state.top_ids.cpu(), state.top_probs.cpu()
    logits = state.logits.cpu() if state.logits is not None else None
    reads = {n: (state.readout_values[n].cpu(), state.readout_indices[n].cpu()) for n in readout}
    rows = []
    for b, n in enumerate(lengths):
        rows.append(EngineRow(prompts[b].cpu(), tokens[b, :n], probs[b, :n], top_ids[b, :n], top_probs[b, :n],
                              logits[b, :n] if logits is not None else None,
                              {layer: SparseCodes(v[b, :n], i[b, :n]) for layer, (v, i) in reads.items()}))
    return tuple(rows)
