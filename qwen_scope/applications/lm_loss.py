"""The next-token LM loss of a causal LM, without its [tokens, vocab] logits in fp32.

``model(input_ids, labels=input_ids).loss`` forms every position's logits (a [B, T, V] tensor; V = 248 320 for
Qwen3.5), upcasts them to fp32 and takes the cross entropy: at 4 096 tokens that is 2 GB of bf16 logits, a 4 GB fp32
copy of them, and the softmax's forward and backward passes over the copy, about 170 ms of a 2B-shaped training step
on an H100 and 6 GB of memory held until the backward. ``causal_lm_loss`` runs the decoder to its final norm and the
head (the ``Linear`` itself, so autocast casts its weight as it would in the causal LM), then one autograd Function
overwrites the logits with the loss's gradient, softmax - onehot, computed in fp32
(``flashqla_kernels.decoder.ops.cross_entropy_``: on Hopper one kernel that reads each row twice and writes it
once; elsewhere torch's fp32 softmax a block of rows at a time). The backward scales that buffer in place by 1 / n
and the incoming gradient (``ops.scale_``) and hands it to the head's backward (dh = G W, dW = G^T h): the GEMMs of
the unfused path, and what waits for the backward is the buffer in the compute dtype.

The numbers are the unfused path's: the logits rounded to the compute dtype, the softmax in fp32, the gradient rounded
to the compute dtype before its GEMMs (twice: softmax - onehot, then its product with 1 / n and the loss's incoming
gradient, where the unfused path rounds the scaled fp32 gradient once). Every position but the last predicts the next
token and counts (the rows are packed text: no padding, no ignored labels); the loss is their mean, transformers' for
such rows.

Models whose head is not a plain bias-free ``Linear`` over the final norm's output (a logit soft-cap, a router's
auxiliary loss in the causal LM's loss) take transformers' own loss.
"""
from __future__ import annotations

import torch
from torch import nn

from flashqla_kernels.decoder import ops

__all__ = ["causal_lm_loss", "fused_head"]

# rows of logits softmaxed at once: 1 GB of fp32 at Qwen3.5's vocabulary
BLOCK_ROWS = 1024


def fused_head(adapter) -> nn.Linear | None:
    """The head ``causal_lm_loss`` multiplies by itself, or None where the causal LM's own loss must be used."""
    head, config = adapter.unembed, adapter.config
    if not isinstance(head, nn.Linear) or head.bias is not None or adapter.text_model is adapter.model:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "output_router_logits", False):
        return None
    return head


def causal_lm_loss(adapter, input_ids: torch.Tensor, *, block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """Mean next-token cross entropy of ``input_ids [B, T]`` (every position 1.. a target), as
    ``model(input_ids=input_ids, labels=input_ids).loss`` gives it, without the fp32 logits.

    Args:
        adapter: the model's ``hooks`` adapter (``Scope.adapter``).
        input_ids: [B, T] token ids, T >= 2.
        block_rows: rows of logits softmaxed at once (memory: ``block_rows * vocab * 4`` bytes).

    Returns:
        A 0-dim fp32 tensor. Its backward runs once (the logits' buffer becomes the gradient: no retain_graph).
        Without grad (an evaluation) the logits exist a block of rows at a time: memory does not grow with the
        batch.
    """
    head = fused_head(adapter)
    if head is None:
        return adapter.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, tokens] with at least 2 tokens a row, got shape "
                         f"{tuple(input_ids.shape)}")
    # the masks of unpadded rows as transformers would build them, without its packed-rows check (which reads its
    # answer back to the host: every forward would wait for the GPU, in a training step for the previous
    # micro-batch's backward, and the host's lead would be lost)
    hidden = adapter.text_model(input_ids=input_ids, attention_mask=adapter.unpadded_masks(),
                                use_cache=False).last_hidden_state
    # The head through the module itself, so autocast casts its weight as in the causal LM (and from its cache);
    # 2-D rows, so the logits are a tensor of their own, not a view, when the Function overwrites them.
    rows = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    if not (torch.is_grad_enabled() and (rows.requires_grad or head.weight.requires_grad)):
        return _loss_by_blocks(head, rows, targets, block_rows)
    loss, _ = _CrossEntropy.apply(head(rows), targets, block_rows)
    return loss


def _loss_by_blocks(head: nn.Linear, rows: torch.Tensor, targets: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The loss alone (no gradient wanted): the head and the softmax a block of rows at a time, so an evaluation of
    many rows holds one block's logits (transformers' loss holds every row's, twice)."""
    loss = torch.zeros((), dtype=torch.float32, device=rows.device)
    for start in range(0, rows.shape[0], block_rows):
        # the block's logits are scratch: the gradient the op writes over them is dropped
        loss += ops.cross_entropy_(head(rows[start:start + block_rows]), targets[start:start + block_rows],
                                   block_rows=block_rows).sum()
    return loss / rows.shape[0]


class _CrossEntropy(torch.autograd.Function):
    """mean_i CE(logits_i, t_i); the forward turns the logits' buffer into the gradient (module doc)."""

    @staticmethod
    def forward(ctx, logits, targets, block_rows):
        n = logits.shape[0]
        # softmax - onehot over the buffer; 1 / n joins the backward's scale
        loss = ops.cross_entropy_(logits, targets, block_rows=block_rows).sum()
        ctx.mark_dirty(logits)
        ctx.mark_non_differentiable(logits)
        ctx.save_for_backward(logits)
        ctx.set_materialize_grads(False)
        ctx.spent, ctx.n = False, n
        return loss / n, logits

    @staticmethod
    def backward(ctx, grad, _):
        if ctx.spent:
            raise RuntimeError("causal_lm_loss's backward ran twice: its logits' buffer holds the gradient and is "
                               "consumed by the first; compute the loss again instead of retain_graph=True")
        ctx.spent = True
        (g,) = ctx.saved_tensors
        if grad is None:
            return None, None, None
        # the scale stays a device tensor (no host sync), multiplied in fp32 and rounded once
        return ops.scale_(g, grad.float() / ctx.n), None, None
