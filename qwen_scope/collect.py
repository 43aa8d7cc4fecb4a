"""Large-scale activation collection: a corpus in, a sharded resumable ``ActivationStore`` out.

Documents are tokenized, packed into rows of ``context_len`` tokens, run through the model (``use_cache=False``, the
forward stops after the deepest requested block) and the requested points are written per token: dense activations
and/or SAE top-k codes, with token ids, document index and context position. Padding is never stored; its fraction
is reported.

Packing (recorded in the manifest as ``bos_policy``):
- ``"concat"`` (default): documents, each followed by ``separator_id`` (the tokenizer's EOS, ``<|endoftext|>`` for
  Qwen), are concatenated and cut into full rows. A row may start mid-document: position 0 is wherever the cut fell.
  Only the very last row is padded.
- ``"document"``: one document per row, truncated to ``context_len`` and right-padded (causal, so padding never
  changes a real token's activation). Position 0 is always a document's first token.
``prepend_bos_id`` puts that token at position 0 of every row (Qwen models use none; the default).

Resume: the row stream is a pure function of (corpus, rank, world size, packing), and every shard records the
packing cursor after it. Rerunning the same call continues after the last recorded shard; a SIGKILL at any moment
loses only the shard in flight. Under ``torchrun`` document ``i`` goes to rank ``i % world_size``; each rank writes
``rank{r:03d}/`` and rank 0 merges ``manifest.json``. The ranks meet three times (the store lock, the end of
collection, the merge) on a gloo group of their own; a rank that does not arrive within ``QWEN_SCOPE_DIST_TIMEOUT_S``
seconds is named in a ``RankTimeoutError`` on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hooks import HYBRID_FAMILIES, get_adapter, parse_hook_name, resid_post
from qwen_scope.collect_corpus import (Row, _corpus_id, _rank_documents, check_yields_tokens, load_corpus,
                                       pack_rows)
from qwen_scope.collect_loop import collect_rank, repair_shards
from qwen_scope.store_files import MANIFEST, StoreBusyError, StoreLock, sweep_temp
from qwen_scope.store_writer import ShardWriter, code_bytes, index_layout, merge_manifest

__all__ = ["collect", "load_corpus", "pack_rows", "Row", "CollectSummary", "RankTimeoutError", "gdn_context"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------- model side
def _model_fingerprint(model: nn.Module) -> str:
    config = model.config.to_json_string(use_diff=True) if hasattr(model, "config") else ""
    w = get_adapter(model).embed.weight
    sample = w[: min(4, w.shape[0]), : min(16, w.shape[1])].detach().float().cpu()
    return hashlib.sha256((config + repr(sample.tolist())).encode()).hexdigest()[:16]


# Seconds a rank waits for the others at one of collect's meeting points before it stops with the ranks that did
# not arrive; ranks hold equal shares of the corpus, so they reach the end within about a shard's time of each other.
DIST_TIMEOUT_ENV = "QWEN_SCOPE_DIST_TIMEOUT_S"
DIST_TIMEOUT_S = 1800.0


class RankTimeoutError(RuntimeError):
    """A torchrun rank did not reach one of collect's meeting points in time (stuck or dead); names the rank."""


def _dist_timeout() -> datetime.timedelta:
    raw = os.environ.get(DIST_TIMEOUT_ENV)
    if raw is None:
        return datetime.timedelta(seconds=DIST_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{DIST_TIMEOUT_ENV}={raw!r}: expected the seconds a rank waits for the others, a number "
                         f"> 0 (default {DIST_TIMEOUT_S:.0f})")
    return datetime.timedelta(seconds=seconds)


def _dist_info() -> tuple[int, int, bool]:
    """``(rank, world_size, created)``: joins the torchrun group (gloo on CPU, NCCL on GPU) when there is one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", timeout=_dist_timeout())
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


class _Ranks:
    """collect's meeting points across torchrun ranks, on a gloo group of its own (the model's NCCL group is not
    used): ``wait(what)`` is gloo's monitored barrier, which tells rank 0 which ranks did not arrive within the
    timeout, and every rank raises ``RankTimeoutError`` naming them (NCCL's own timeout would abort the process
    with the collective's sequence number and no rank). One rank alone: nothing to wait for."""

    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        self.rank, self.world, self.timeout, self.group = rank, world, _dist_timeout(), None
        if world > 1 and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)

    def wait(self, what: str) -> None:
        import torch.distributed as dist

        if self.group is None:
            return
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise RankTimeoutError(self._message(str(err), what)) from None

    def broadcast(self, obj):
        """rank 0's ``obj`` on every rank (after a ``wait``, so a rank that never comes is named)."""
        import torch.distributed as dist

        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None

    def _message(self, err: str, what: str) -> str:
        seconds = f"{self.timeout.total_seconds():.0f} s"
        fix = (f"see that rank's log; rerun the same command to resume (every recorded shard is kept), and raise "
               f"{DIST_TIMEOUT_ENV} if a rank is only slow")
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", err)
        if self.rank == 0 and missing:
            ranks = ", ".join(r.strip() for r in missing.group(1).split(",") if r.strip())
            return f"rank(s) {ranks} of {self.world} did not reach {what} within {seconds}; {fix}"
        if "Timed out" in err or "timed out" in err:
            return (f"rank 0 of {self.world} did not reach {what} within {seconds} (seen from rank "
                    f"{self.rank}); {fix}")
        return (f"rank {self.rank} of {self.world} stopped at {what}: rank 0 found a rank missing or ended "
                f"(its log names the rank); rerun the same command to resume")


def _resolve_model(model, tokenizer, dtype, device, rank):
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        name = str(model)
        device = torch.device(device or (f"cuda:{os.environ.get('LOCAL_RANK', rank)}"
                                         if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(name)
    else:
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if device != next(model.parameters()).device or (dtype and dtype != next(model.parameters()).dtype):
            model = model.to(device=device, dtype=dtype)
        if tokenizer is None and name and Path(name).exists():
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(name)
    return model, tokenizer, device, next(model.parameters()).dtype, name


def _resolve_saes(saes, release, sae_layers, adapter, device, sae_dtype) -> dict[str, nn.Module]:
    """``{resid_post(n): TopKSAE}`` from ready SAEs or a release (all layers unless ``sae_layers``)."""
    if saes is not None:
        return {parse_hook_name(resid_post(n), adapter.n_layers).name: sae for n, sae in dict(saes).items()}
    if release is None:
        if sae_layers:
            raise ValueError(f"sae_layers={list(sae_layers)} needs release=... (--release), e.g. "
                             f"'qwen-scope-3.5-2b-base-w32k-l100' or a local release directory")
        return {}
    from saes.loading import load

    out = {}
    for n in (range(adapter.n_layers) if sae_layers is None else sae_layers):
        point = parse_hook_name(resid_post(n), adapter.n_layers)
        sae = load(release, point.layer, device=device, dtype=sae_dtype,
                   expected_d_model=adapter.d_model)
        sae.compute_dtype = sae_dtype
        out[point.name] = sae
    return out


def _auto_shard_tokens(points: dict, value_bytes: int) -> int:
    """Tokens per ~1 GiB shard (dense rows, k codes per SAE point in their layout), capped at 2^18."""
    per_token = 16 + sum(value_bytes * p["d_model"] * p["dense"] +
                         (p["sae"]["k"] * code_bytes(p["sae"]["d_sae"], p["sae"]["k"], value_bytes) if p["sae"] else 0)
                         for p in points.values())
    return min(1 << 18, int((1 << 30) // per_token))


def _sae_reference(sae, release) -> str:
    """What ``saes.load`` can load again (``qwen-scope explore`` reads it from the store): a catalogue id, else the
    release directory. The id ``saes`` derives from a local ``SAE-Res-...`` directory name is not loadable."""
    from saes import get_release

    rel_id = getattr(getattr(sae, "release", None), "id", None)
    if rel_id is not None:
        try:
            if get_release(rel_id).registered:  # an unregistered set's id names a hub repo, not the local files
                return rel_id
        except ValueError:
            pass
    if release and Path(str(release)).expanduser().exists():
        return str(Path(str(release)).expanduser().resolve())
    if release:
        return str(release)
    source = getattr(sae, "source", None)
    if source and Path(source).is_file():
        return str(Path(source).resolve().parent)
    return rel_id or source or "custom"


def _sae_info(sae, release) -> dict:
    sample = sae.W_enc.detach()[:4, :8].float().cpu().tolist()
    rel = _sae_reference(sae, release)
    return {"release": rel, "layer": getattr(sae, "layer", None), "k": sae.k, "d_sae": sae.d_sae,
            "index_layout": index_layout(sae.d_sae), "dtype": str(sae.W_enc.dtype).removeprefix("torch."),
            "weights_sample": hashlib.sha256(repr(sample).encode()).hexdigest()[:16]}


# ---------------------------------------------------------------------------------------------- the verb
@dataclass(frozen=True)
class CollectSummary:
    """What a ``collect`` call did (rank 0 reports the whole store once every rank is done)."""

    out_dir: str
    n_tokens: int
    n_tokens_this_run: int
    n_shards: int
    padding_fraction: float
    seconds: float
    tokens_per_s: float
    bytes: int
    world_size: int
    complete: bool
    gdn: str = ""
    n_tokens_repaired: int = 0

    def __str__(self) -> str:
        return (f"collected {self.n_tokens:,} tokens into {self.out_dir} ({self.n_shards} shards, "
                f"{self.bytes / 2**30:.2f} GiB, {self.world_size} rank(s)); this run {self.n_tokens_this_run:,} "
                f"tokens in {self.seconds:.1f} s = {self.tokens_per_s:,.0f} tokens/s; padding "
                f"{100 * self.padding_fraction:.2f}%; complete={self.complete}"
                + (f"; repaired {self.n_tokens_repaired:,} tokens" if self.n_tokens_repaired else "")
                + (f"; GDN layers: {self.gdn}" if self.gdn else ""))


def collect(model: nn.Module | str, corpus, *, points: Sequence[str] | None = None,
            sae_layers: Sequence[int] | None = None, release: str | None = None, saes: dict | None = None,
            token_budget: int, context_len: int = 1024, out_dir: str | os.PathLike, batch_size: int = 8,
            dtype: torch.dtype | None = None, store_dtype: torch.dtype = torch.bfloat16,
            sae_dtype: torch.dtype | None = None, text_column: str = "text", tokenizer=None,
            packing: str = "concat", separator_id: int | str | None = "eos", prepend_bos_id: int | None = None,
            shard_tokens: int | None = None, device: str | torch.device | None = None, overwrite: bool = False,
            progress: bool = True, corpus_id: str | None = None, gdn_kernels: bool | None = None,
            on_step: Callable[[int], None] | None = None, repair: bool = False) -> CollectSummary:
    """Collect activations and/or SAE codes of ``token_budget`` corpus tokens into a sharded store at ``out_dir``.

    Args:
        model: a loaded Qwen model or a model id / directory (loaded in ``dtype``; bf16 on GPU by default).
        corpus: a ``datasets`` Dataset/IterableDataset (see ``load_corpus``) or a list of strings / dicts.
        points: hook points stored dense, e.g. ``["resid_post.12"]`` (any alias ``hooks`` accepts).
        sae_layers, release: store SAE codes (top-k values + indices) at ``resid_post.<n>`` of these layers, from
            this release (all layers when ``sae_layers`` is None). saes: ready ``{layer: TopKSAE}`` instead.
        token_budget: real tokens to store, over all ranks. context_len: tokens per packed row.
        out_dir: the store directory. batch_size: rows per forward ``[batch_size, context_len]``.
        dtype: model compute dtype; store_dtype: dense and code-value dtype on disk (bf16 default);
            sae_dtype: SAE weight/compute dtype (default: the model's).
        text_column: corpus column with text (a pre-tokenized ``input_ids`` column also works). tokenizer:
            needed for text when ``model`` is not an id. packing, separator_id (``"eos"`` = the tokenizer's
            EOS, None for none), prepend_bos_id: see the module doc.
        shard_tokens: about this many tokens per shard, rounded to whole batches (default: shards of ~1 GiB, at
            most 2^18 tokens).
        overwrite: discard a previous collection of another config in ``out_dir`` (the same config resumes).
        repair: recompute the recorded shards a previous run left missing or damaged (the row stream is
            deterministic, so the repaired store equals an uninterrupted run); without it such a store is an error
            naming them. One collect run writes a store at a time: a second gets an error naming the first.
        progress: show a progress bar with tokens/s and ETA, then the summary (rank 0).
        corpus_id: names the corpus in the config hash when it has no ``datasets`` fingerprint (streaming).
        gdn_kernels: run the Gated DeltaNet layers (Qwen3.5, Qwen3-Next) on ``flashqla_kernels``' fused layer for
            the call (``patched_transformers(fused_layer=True)``, restored after). None (default): when the model
            is on a Hopper GPU with tilelang installed and the caller has not patched transformers already. True:
            always (the fused path's torch formulation off Hopper). False: the model as loaded.
        on_step: called on each rank after each forward step's outputs have reached the host (queued for the
            shard writer), with the rank's tokens stored so far: logging, or timing the steady state
            (``benchmarks/collect_throughput.py``). An exception it raises stops the run like any other (the
            shards already written are kept; a rerun resumes).
    Returns:
        ``CollectSummary``; the store is read with ``ActivationStore(out_dir)``.

    Example:
        >>> corpus = load_corpus("data/*.jsonl")
        >>> collect("Qwen/Qwen3.5-2B-Base", corpus, sae_layers=[12], release="qwen-scope-3.5-2b-base-w32k-l100",
        ...         token_budget=10_000_000, context_len=1024, out_dir="acts/")
    """
    _check_settings(token_budget=token_budget, context_len=context_len, batch_size=batch_size,
                    shard_tokens=shard_tokens, out_dir=out_dir)
    rank, world, created = _dist_info()
    store_lock = writer = ranks = None
    try:
        ranks = _Ranks(rank, world)
        model, tokenizer, device, dtype, name = _resolve_model(model, tokenizer, dtype, device, rank)
        adapter = get_adapter(model)
        dense = list(dict.fromkeys(parse_hook_name(p, adapter.n_layers).name for p in (points or [])))
        sae_dtype = sae_dtype or dtype
        sae_map = _resolve_saes(saes, release, sae_layers, adapter, device, sae_dtype)
        if not dense and not sae_map:
            raise ValueError("nothing to collect: pass points=[...] (--points) and/or sae_layers + release")
        if separator_id == "eos":
            separator_id = getattr(tokenizer, "eos_token_id", None)
        pad_id = separator_id if separator_id is not None else 0
        info = {p: {"dense": p in dense, "d_model": adapter.d_model,
                    "sae": _sae_info(sae_map[p], release) if p in sae_map else None}
                for p in dict.fromkeys(dense + list(sae_map))}
        first = next(iter(sae_map.values()), None)
        shard_tokens = shard_tokens or _auto_shard_tokens(info, torch.empty(0, dtype=store_dtype).element_size())
        config = {
            "model": name, "model_fingerprint": _model_fingerprint(model), "family": adapter.family,
            "points": info, "sae": None if first is None else {
                "release": info[next(iter(sae_map))]["sae"]["release"], "k": first.k, "d_sae": first.d_sae,
                "layers": [int(p.split(".")[1]) for p in sae_map]},
            "context_len": context_len, "batch_size": batch_size, "token_budget": token_budget,
            "dtype": str(dtype).removeprefix("torch."), "store_dtype": str(store_dtype).removeprefix("torch."),
            "bos_policy": {"packing": packing, "separator_id": separator_id, "prepend_bos_id": prepend_bos_id,
                           "positions": "context position in the packed row; in 'concat' packing a row may "
                                        "start mid-document, so position 0 is not always a document start"},
            "corpus": corpus_id or _corpus_id(corpus), "text_column": text_column, "world_size": world,
            "rows_per_shard": batch_size * max(1, shard_tokens // (batch_size * context_len)),
            "use_cache": False}
        store_lock = _lock_store(Path(out_dir), rank, ranks)
        writer = ShardWriter(out_dir, config, rank=rank, world_size=world, overwrite=overwrite, repair=repair)
        if (overwrite or writer.damaged) and rank == 0:
            # a repair changes recorded shards: readers see the rank progress files until the new manifest
            (Path(out_dir) / MANIFEST).unlink(missing_ok=True)
        if overwrite and rank == 0:
            _remove_extra_ranks(Path(out_dir), world)
        if not writer.shards:
            check_yields_tokens(corpus, rank, world, text_column, tokenizer, config["corpus"])
        patch, gdn = gdn_context(adapter, device, gdn_kernels)
        with patch:
            repaired = repair_shards(writer, adapter, _rows_from(corpus, tokenizer, config, rank, world), device,
                                     dense, sae_map, config, pad_id, _DTYPES[config["store_dtype"]])
            run = _collect_rank(writer, adapter, corpus, tokenizer, device, dense, sae_map, config, pad_id,
                                progress and rank == 0, on_step)
        summary = dataclasses.replace(_finish(writer, {**run, "tokens_repaired": repaired}, ranks), gdn=gdn)
        if progress and rank == 0:
            print(summary)
        return summary
    finally:
        if writer is not None:
            writer.close()
        if store_lock is not None:
            store_lock.release()
        if ranks is not None:
            ranks.close()
        if created:
            import torch.distributed as dist
            dist.destroy_process_group()


def _check_settings(*, token_budget, context_len, batch_size, shard_tokens, out_dir) -> None:
    """Refuse settings that cannot make a store, before anything is loaded or written."""
    for name, value, flag in (("token_budget", token_budget, "--tokens"), ("context_len", context_len,
                              "--context-len"), ("batch_size", batch_size, "--batch-size"),
                              ("shard_tokens", shard_tokens, "--shard-tokens")):
        if value is None and name == "shard_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({flag}) must be a whole number >= 1, got {value!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir (--out) {out} is a file; expected a directory: a new one, or a store to resume")


def _lock_store(root: Path, rank: int, ranks: _Ranks) -> StoreLock | None:
    """Rank 0 takes the store's writer lock and sweeps its temp folder; every rank learns whether it got it."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = StoreLock(root)
            sweep_temp(root)
        except StoreBusyError as err:
            error = str(err)
    ranks.wait("the start (the store lock)")
    error = ranks.broadcast(error)
    if error is not None:
        raise StoreBusyError(error)
    return lock


def gdn_context(adapter, device: torch.device, wanted: bool | None) -> tuple[contextlib.AbstractContextManager, str]:
    """The transformers patch the collection runs under, and how the GDN layers run, in words."""
    if wanted is False:
        return contextlib.nullcontext(), "as loaded (gdn_kernels=False)" if adapter.hybrid else ""
    if not adapter.hybrid:
        if wanted:
            raise ValueError(f"gdn_kernels=True but {adapter.family!r} models have no Gated DeltaNet layers "
                             f"(families with them: {', '.join(HYBRID_FAMILIES)}); leave gdn_kernels unset")
        return contextlib.nullcontext(), ""
    import flashqla_kernels

    if wanted is None:
        if flashqla_kernels.is_patched():
            return contextlib.nullcontext(), "as patched by the caller (flashqla_kernels)"
        if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
            return contextlib.nullcontext(), f"transformers' own path (fused kernels need a Hopper GPU; {device})"
        try:
            import tilelang  # noqa: F401
        except ImportError:
            return contextlib.nullcontext(), "transformers' own path (install tilelang for the fused kernels)"
    return flashqla_kernels.patched_transformers(fused_layer=True), "fused layer (flashqla_kernels)"


def _remove_extra_ranks(root: Path, world: int) -> None:
    """Delete ``rank{r}/`` of an earlier run with more ranks: no writer of this run clears them, and the manifest
    merge would find their progress files and refuse the directory as a mix of two collections."""
    for d in root.glob("rank*"):
        m = re.fullmatch(r"rank(\d+)", d.name)
        if m and d.is_dir() and int(m.group(1)) >= world:
            shutil.rmtree(d)


def _rows_from(corpus, tokenizer, config: dict, rank: int, world: int) -> Callable:
    """``cursor -> rows``: this rank's packed rows from a cursor on."""
    policy = config["bos_policy"]

    def rows(cursor: tuple[int, int]):
        return pack_rows(_rank_documents(corpus, rank, world, cursor[0], config["text_column"], tokenizer),
                         config["context_len"], packing=policy["packing"], separator_id=policy["separator_id"],
                         prepend_bos_id=policy["prepend_bos_id"], start=cursor)

    return rows


def _collect_rank(writer: ShardWriter, adapter, corpus, tokenizer, device, dense, sae_map, config, pad_id,
                  progress: bool, on_step: Callable[[int], None] | None) -> dict:
    """This rank's rows from the writer's resume cursor, through ``collect_loop.collect_rank``."""
    cursor = tuple(writer.cursor or (0, 0))
    exhausted = writer.complete or cursor[0] < 0
    rows = iter(()) if exhausted else _rows_from(corpus, tokenizer, config, writer.rank, writer.world_size)(cursor)
    return collect_rank(writer, adapter, rows, device, dense, sae_map, config, pad_id,
                        _DTYPES[config["store_dtype"]], progress, on_step)


def _finish(writer: ShardWriter, run: dict, ranks: _Ranks) -> CollectSummary:
    writer.finish(run)
    ranks.wait("the end of collection (every rank's last shard recorded)")
    manifest = merge_manifest(writer.root, write=writer.rank == 0)
    ranks.wait("the manifest merge")
    stats = manifest["rank_stats"]
    seconds = max(s.get("seconds", 0.0) for s in stats) if stats else run["seconds"]
    this_run = sum(s.get("tokens_this_run", 0) for s in stats)
    summary = CollectSummary(str(writer.root), manifest["n_tokens"], this_run, len(manifest["shards"]),
                             manifest["padding_fraction"], seconds, this_run / max(seconds, 1e-9),
                             sum(s["bytes"] for s in manifest["shards"]), ranks.world, manifest["complete"],
                             n_tokens_repaired=sum(s.get("tokens_repaired", 0) for s in stats))
    if writer.rank == 0 and run.get("corpus_exhausted"):
        print(f"note: the corpus ran out before token_budget on rank 0 ({run['tokens']:,} tokens)")
    return summary
