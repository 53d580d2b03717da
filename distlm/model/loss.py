"""Next-token cross-entropy.

``lm_loss`` takes logits: parallel plans that own the logits use it (a vocabulary-
parallel head computes it under ``loss_parallel``; a pipeline runs it on the last stage).
``chunked_head_loss`` takes the final hidden states and the head's weight instead and
never builds the whole (tokens x vocabulary) logits tensor: for GPT-2's 50k vocabulary
at 32k tokens per micro-batch those are 3.3 GB in bf16, 6.6 GB more in fp32, more than
every activation of a 124M model together.

With ``softcap`` > 0 (model.logit_softcap) the logits are ``cap * tanh(z / cap)`` of the
head's output z; the whole-logits path receives them capped from the head
(``SoftcapLinear``), the chunked path caps each chunk and includes the cap's derivative
in the gradients it forms.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 softmax: under bf16 autocast the log-sum-exp over 50k logits loses digits.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def _chunk_loss(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, softcap: float = 0.0):
    logits = (x @ w.t()).float()
    if softcap:
        if torch.compiler.is_compiling():
            logits = softcap * torch.tanh(logits / softcap)
        else:  # in place: eager would otherwise hold two more (rows x vocabulary) copies
            logits.div_(softcap).tanh_().mul_(softcap)
    lse = torch.logsumexp(logits, dim=-1)
    return (lse - logits.gather(1, t[:, None]).squeeze(1)).sum(), logits, lse


def _chunk_loss_and_grads(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, scale: float, softcap: float = 0.0):
    """Loss sum and gradients of one chunk of rows. x (n, d), w (V, d), t (n,), all in the
    compute dtype; softmax statistics in fp32. With a softcap, ``logits`` are the capped
    c = cap tanh(z / cap), and dc/dz = 1 - tanh^2 = 1 - (c / cap)^2 multiplies dL/dc."""
    loss, logits, lse = _chunk_loss(x, w, t, softcap)
    # d(mean CE)/d logits = (softmax - onehot) / N. Written as one element-wise expression
    # (no in-place scatter), so that compiled it is a single pass over the logits that
    # writes the gradient straight in the compute dtype (measured on H200: an in-place
    # version cost an extra fp32 pass, 13 ms against 9 ms per step for the whole logits).
    # Eager, the same expression would build a (rows x vocabulary) one-hot tensor, so there
    # the 1 is subtracted in place instead.
    if torch.compiler.is_compiling():
        onehot = torch.arange(logits.shape[1], device=t.device)[None, :] == t[:, None]
        g = (torch.exp(logits - lse[:, None]) - onehot.float()) * scale
        if softcap:
            g = g * (1.0 - (logits / softcap) ** 2)
        g = g.to(x.dtype)
    else:
        g = torch.exp(logits - lse[:, None])
        g.scatter_add_(1, t[:, None], torch.full_like(lse[:, None], -1.0))
        if softcap:  # the logits are not needed after this: turn them into dc/dz in place
            g.mul_(logits.div_(softcap).square_().neg_().add_(1.0))
        g = (g * scale).to(x.dtype)
    return loss, g @ w, g.t() @ x


class _ChunkedHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of x @ w.T against targets, chunk by chunk.

    Each chunk's gradient is computed in the forward, while its logits exist, and the
    logits are dropped; backward only scales the stored gradients. Memory: one chunk of
    logits instead of all of them. FLOPs: the same three matmuls as the plain path.
    """

    @staticmethod
    def forward(ctx, x, w, targets, chunk: int, dtype: torch.dtype, softcap: float):
        n = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            xc, wc = x.to(dtype), w.to(dtype)
            grad_x = torch.empty_like(xc)
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            for s in range(0, n, chunk):
                lsum, gx, gw = _chunk_loss_and_grads(xc[s:s + chunk], wc, targets[s:s + chunk], 1.0 / n, softcap)
                loss = loss + lsum
                grad_x[s:s + chunk] = gx
                grad_w += gw  # fp32 sum over chunks
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (x.dtype, w.dtype)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return ((grad_x * grad_out).to(ctx.dtypes[0]), (grad_w * grad_out).to(ctx.dtypes[1]),
                None, None, None, None)


def chunked_head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                      softcap: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy of the head ``weight`` (V, d) applied to hidden states
    x (B, T, d), ``chunk`` tokens at a time, the logits soft-capped at ``softcap`` (0 = off).
    Under autocast the matmuls run in its dtype, as nn.Linear's would."""
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    x, targets = x.flatten(0, 1), targets.flatten(0, 1)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _ChunkedHeadLoss.apply(x, weight, targets, chunk, dtype, softcap)
    # evaluation: the same chunks, no gradients
    with torch.autocast(dev, enabled=False):
        xc, wc = x.to(dtype), weight.to(dtype)
        total = sum(_chunk_loss(xc[s:s + chunk], wc, targets[s:s + chunk], softcap)[0]
                    for s in range(0, x.shape[0], chunk))
    return total / x.shape[0]
