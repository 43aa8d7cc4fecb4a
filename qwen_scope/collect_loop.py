"""The per-rank collection loop of ``qwen_scope.collect``: packed rows -> batches -> GPU steps -> shards.

Built so the GPU never waits for the host (measured on an H200: each host sync in the loop exposed the next
forward's ~1000 kernel launches, and collection with one SAE layer ran at 87% of a bare forward):

- a prefetch thread tokenizes and packs the next batches, in pinned memory when the model is on CUDA, so the
  host-to-device copies are asynchronous;
- a step launches the forward, the SAE encodes (``saes.fused_encode_async``: no host sync) and asynchronous copies of
  the results into pinned memory, on a copy stream of their own so they overlap the next step's forward instead of
  queueing in front of it; it is *finished* one step later, when the next step is already queued on the GPU:
  its copies are complete by then, and the rare encode that could not certify every row in place (``overflow``) is
  recomputed exactly from the activations kept for that one step;
- shards are written, fsynced and hashed by ``ShardWriter``'s writer threads; when the loop stops on an error (or
  Ctrl-C) the shards already written are recorded first. Shards hold whole batches, so a resumed run forms exactly
  the batches of an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from hooks import capture_forward
from qwen_scope.store_writer import ShardWriter, index_layout, pack_indices

__all__ = ["collect_rank", "repair_shards"]

_END = object()


# ---------------------------------------------------------------------------------------------- batches
@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows ready for the device (built in the prefetch thread): ``ids``/``keep`` ``[B, context_len]``."""

    rows: list
    ids: torch.Tensor
    keep: torch.Tensor
    doc_index: torch.Tensor
    n_tokens: int
    full: bool
    keep_index: torch.Tensor  # flat positions of the real tokens (gathered without a device-side mask and its sync)


def batches(rows: Iterator, budget: int, batch_size: int, context_len: int, pad_id: int,
            pin: bool = False) -> Iterator[Batch]:
    """Group rows into right-padded batches until ``budget`` real tokens (the last row is cut to fit); ``pin`` puts
    the token ids in pinned memory for an asynchronous copy to the GPU."""
    while budget > 0:
        batch, n = [], 0
        while len(batch) < batch_size and n < budget:
            row = next(rows, None)
            if row is None:
                break
            if len(row.tokens) > budget - n:
                row = dataclasses.replace(row, tokens=row.tokens[:budget - n], doc_index=row.doc_index[:budget - n])
            batch.append(row)
            n += len(row.tokens)
        if not batch:
            return
        ids = torch.full((len(batch), context_len), pad_id, dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, :len(row.tokens)] = torch.tensor(row.tokens)
        keep = torch.arange(context_len)[None] < torch.tensor([len(r.tokens) for r in batch])[:, None]
        index = keep.flatten().nonzero().squeeze(1)
        docs = torch.tensor([d for r in batch for d in r.doc_index])
        yield Batch(batch, ids.pin_memory() if pin else ids, keep, docs, n, bool(keep.all()),
                    index.pin_memory() if pin else index)
        budget -= n


def prefetch(items: Iterator, depth: int = 2) -> Iterator:
    """Produce ``items`` in a background thread (tokenizing, packing) while the GPU runs the previous batch."""
    slots: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                slots.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for x in items:
                if not put(x):
                    return
            put(_END)
        except BaseException as err:  # handed to the consumer, re-raised there
            put(err)

    threading.Thread(target=work, daemon=True, name="collect-prefetch").start()
    try:
        while (x := slots.get()) is not _END:
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:
        stop.set()


# ---------------------------------------------------------------------------------------------- steps
def encoder(sae) -> Callable[[torch.Tensor], tuple]:
    """``x [n, d_model] -> (SparseCodes, overflow or None)``: ``saes.fused_encode_async`` (TileLang on Hopper, no
    host sync; ``overflow`` a device flag) where present, else ``encode_sparse`` (exact, no flag)."""
    try:
        from saes.fused import fused_encode_async
    except ImportError:
        return lambda x: (sae.encode_sparse(x), None)
    return lambda x: fused_encode_async(x, sae)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Copy to the CPU: small tensors asynchronously into pinned memory (finished when the step's event is), large
    ones (dense captures, 100s of MB) into pageable memory, which does not grow the pinned cache by power-of-two
    blocks (that copy waits for the GPU)."""
    if t.device.type == "cpu":
        return t.contiguous()
    if t.numel() * t.element_size() > 1 << 26:
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


_COPY_STREAMS: dict = {}


def copy_stream(device: torch.device):
    """The side stream a CUDA device's device-to-host copies run on (one per device, made on first use)."""
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device=key)
    return _COPY_STREAMS[key]


def copy_out(device: torch.device, tensors: dict[str, torch.Tensor]) -> tuple[dict, torch.cuda.Event | None]:
    """``to_host`` of every tensor, on CUDA on the copy stream once the compute stream has produced them; returns
    the host tensors and the event that completes them (None on CPU). Each source is marked used by the copy stream,
    so the caching allocator does not hand its memory to the next step before the copy has read it."""
    if device.type != "cuda":
        return {k: to_host(t) for k, t in tensors.items()}, None
    stream = copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        out = {}
        for k, t in tensors.items():
            out[k] = to_host(t)
            if t.device.type == "cuda":
                t.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return out, done


@dataclasses.dataclass
class Step:
    """One launched batch: host columns (copies possibly in flight), the event that completes them, and the encodes
    to verify when it is finished: ``(column name, overflow flag on the host, activations, sae)``."""

    batch: Batch
    out: dict[str, torch.Tensor]
    event: torch.cuda.Event | None
    pending: list = dataclasses.field(default_factory=list)


STEP_MARK = "qwen_scope.collect.launch"  # a profiler range per launched step (benchmarks/collect_profile.py)


def launch(adapter, batch: Batch, device: torch.device, dense: list[str], encoders: dict, saes: dict,
           store_dtype: torch.dtype) -> Step:
    """Queue one batch on the device: forward (stopping after the deepest requested block), encodes, copies."""
    with torch.profiler.record_function(STEP_MARK):
        return _launch(adapter, batch, device, dense, encoders, saes, store_dtype)


def _launch(adapter, batch: Batch, device: torch.device, dense: list[str], encoders: dict, saes: dict,
            store_dtype: torch.dtype) -> Step:
    B, L = batch.ids.shape
    ids = batch.ids.to(device, non_blocking=True)
    # batches are right-padded, never packed: the text model runs without masks where it takes them as a mapping
    # (no lm_head is needed: the forward stops after the deepest point), which spares transformers' packed-sequence
    # check and its device sync, one a step that left the H200 idle while the host caught up
    masks = adapter.unpadded_masks()
    if masks is None:
        cap = capture_forward(adapter.model, dense + list(encoders), input_ids=ids)
    else:
        cap = capture_forward(adapter.text_model, dense + list(encoders), input_ids=ids, attention_mask=masks)
    index = None if batch.full else batch.keep_index.to(device, non_blocking=True)
    if batch.full:  # no mask to apply (boolean indexing of [B, L] on the host costs ~ms a column)
        token_ids, positions = batch.ids.reshape(-1).int(), torch.arange(L, dtype=torch.int32).repeat(B)
    else:
        token_ids, positions = batch.ids[batch.keep].int(), torch.arange(L).expand(B, -1)[batch.keep].int()
    step = Step(batch, {"token_ids": token_ids, "doc_index": batch.doc_index, "positions": positions}, None)
    results, flags = {}, []
    with torch.no_grad():
        acts = {name: cap[name].reshape(-1, adapter.d_model) if index is None else
                cap[name].reshape(-1, adapter.d_model).index_select(0, index)
                for name in dict.fromkeys(dense + list(encoders))}
        for name in dense:
            results[f"dense.{name}"] = acts[name].to(store_dtype)
        for name, encode in encoders.items():
            codes, overflow = encode(acts[name])
            results[f"sae.{name}.values"] = codes.values.to(store_dtype)
            # packed on the device: the copy to the host and the shard carry 2 bytes an index, not 8
            for suffix, t in pack_indices(codes.indices, index_layout(saes[name].d_sae)).items():
                results[f"sae.{name}.{suffix}"] = t
            if overflow is not None:
                results[f"overflow.{name}"] = overflow.reshape(1)
                flags.append(name)
    host, step.event = copy_out(device, results)
    step.out.update({k: v for k, v in host.items() if not k.startswith("overflow.")})
    step.pending = [(name, host[f"overflow.{name}"], acts[name], saes[name]) for name in flags]
    return step


def finish(step: Step, store_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Wait for the step's copies; recompute exactly (``fused_encode``) any encode that flagged an overflow."""
    if step.event is not None:
        step.event.synchronize()
        # the pinned copies go back to torch's pinned cache now, not when the shard holding them is written: else
        # every step allocates new pinned memory (cudaHostAlloc, ~3 ms each on the H200, and it holds the driver
        # while the main thread launches the next forward)
        step.out = {k: v.clone() if v.is_pinned() else v for k, v in step.out.items()}
    for name, overflow, acts, sae in step.pending:
        if bool(overflow[0]):
            from saes.fused import fused_encode

            codes = fused_encode(acts, sae)
            step.out[f"sae.{name}.values"] = codes.values.to(store_dtype).cpu()
            for suffix, t in pack_indices(codes.indices, index_layout(sae.d_sae)).items():
                step.out[f"sae.{name}.{suffix}"] = t.cpu()
    step.pending.clear()  # frees the kept activations
    return step.out


# ---------------------------------------------------------------------------------------------- the loop
def collect_rank(writer: ShardWriter, adapter, rows: Iterator, device: torch.device, dense: list[str], sae_map: dict,
                 config: dict, pad_id: int, store_dtype: torch.dtype, progress: bool,
                 on_step: Callable[[int], None] | None = None) -> dict:
    """This rank's loop from the writer's resume point to its share of the token budget.

    Args:
        writer: the rank's ``ShardWriter`` (resume cursor, tokens stored). adapter: the model's ``hooks`` adapter.
        rows: packed rows from the resume cursor on. device: the model's device. dense: points stored dense.
        sae_map: ``{point: TopKSAE}`` encoded and stored as codes. config: the store config (budget, batch and
        shard sizes). pad_id: right-padding token. store_dtype: dtype of dense rows and code values on disk.
        progress: show the bar. on_step: called with the tokens stored so far after each step reaches the host.
    Returns:
        ``{"rank", "tokens_this_run", "seconds", "tokens", "corpus_exhausted"}``.
    """
    from qwen_scope.sources import progress_bar

    world, rank = writer.world_size, writer.rank
    budget = config["token_budget"] // world + (rank < config["token_budget"] % world)
    context_len, batch_size, rows_per_shard = config["context_len"], config["batch_size"], config["rows_per_shard"]
    stored = start_tokens = writer.n_tokens
    encoders = {name: encoder(sae) for name, sae in sae_map.items()}
    bar = progress_bar(total=budget, initial=stored, unit="tok", unit_scale=True, disable=not progress,
                       desc=f"collect rank {rank}", smoothing=0.1)
    t0, shard, shard_rows, shard_pad, after, queued = time.perf_counter(), [], 0, 0, (-1, 0), None

    def finish_step(step: Step) -> None:
        nonlocal stored, shard_rows, shard_pad, after
        shard.append(finish(step, store_dtype))
        batch = step.batch
        stored, shard_rows = stored + batch.n_tokens, shard_rows + len(batch.rows)
        shard_pad += len(batch.rows) * context_len - batch.n_tokens
        after = batch.rows[-1].cursor
        bar.update(batch.n_tokens)
        padded = writer.n_pad + shard_pad
        bar.set_postfix(pad=f"{100 * padded / max(1, padded + stored):.1f}%", refresh=False)
        if shard_rows >= rows_per_shard:
            write_shard()
        if on_step is not None:
            on_step(stored)

    def write_shard() -> None:
        nonlocal shard, shard_rows, shard_pad
        tensors = {k: torch.cat([p[k] for p in shard]) if len(shard) > 1 else shard[0][k] for k in shard[0]}
        writer.write(tensors, n_rows=shard_rows, n_pad=shard_pad, cursor=list(after))
        shard, shard_rows, shard_pad = [], 0, 0

    try:
        todo = batches(rows, budget - stored, batch_size, context_len, pad_id, pin=device.type == "cuda")
        for batch in prefetch(todo):
            step = launch(adapter, batch, device, dense, encoders, sae_map, store_dtype)
            if queued is not None:
                finish_step(queued)  # the previous step, while this one runs on the GPU
            queued = step
        if queued is not None:
            finish_step(queued)
        if shard:
            write_shard()
    except BaseException:
        with contextlib.suppress(Exception):
            writer.flush()  # record the shards already on disk: a rerun resumes after them
        raise
    writer.flush()
    bar.close()
    return {"rank": rank, "tokens_this_run": stored - start_tokens, "seconds": time.perf_counter() - t0,
            "tokens": stored, "corpus_exhausted": stored < budget}


def repair_shards(writer: ShardWriter, adapter, rows_from: Callable[[tuple[int, int]], Iterator],
                  device: torch.device, dense: list[str], sae_map: dict, config: dict, pad_id: int,
                  store_dtype: torch.dtype) -> int:
    """Recompute the writer's damaged shards, each from the cursor its predecessor recorded; return their tokens.

    A shard holds whole batches of the row stream and the stream is a pure function of the cursor, so each shard is
    rebuilt batch for batch as the uninterrupted run built it (``ShardWriter.rewrite`` checks the rows match).
    """
    encoders = {name: encoder(sae) for name, sae in sae_map.items()}
    context_len, repaired = config["context_len"], 0
    for position, _ in list(writer.damaged):
        record = writer.shards[position]
        start = tuple(writer.shards[position - 1]["cursor"]) if position else (0, 0)
        parts, n_rows, n_pad, after = [], 0, 0, None
        for batch in batches(rows_from(start), record["n_tokens"], config["batch_size"], context_len, pad_id,
                             pin=device.type == "cuda"):
            step = launch(adapter, batch, device, dense, encoders, sae_map, store_dtype)
            parts.append(finish(step, store_dtype))
            n_rows, n_pad = n_rows + len(batch.rows), n_pad + len(batch.rows) * context_len - batch.n_tokens
            after = batch.rows[-1].cursor
        if not parts:
            raise ValueError(f"{writer.root / record['file']}: the corpus yields no rows from cursor {list(start)} "
                             f"on, so the shard cannot be recomputed; rerun with --overwrite")
        tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        writer.rewrite(position, tensors, n_rows=n_rows, n_pad=n_pad, cursor=list(after))
        repaired += record["n_tokens"]
    return repaired
