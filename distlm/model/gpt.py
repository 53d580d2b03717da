"""A decoder-only GPT as a plain nn.Module. Imports only torch and the config.

Every option (positions, norm, MLP, tying, bias, dropout, and the "modern block":
QK-norm, ReLU^2, zero-initialised projections, logit soft-cap, value embeddings, U-net
skips, document and sliding-window attention) is a config field, off by default; the
model never asks which rank it is on. Parallelism is applied to it from
outside (distlm.parallel). It can be built on the meta device and initialised
after sharding with ``init_weights()``.
"""
from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlm.config import ConfigError, ModelConfig
from distlm.local_shard import local_shard
from distlm.model.attention import attend, block_mask, dense_mask, document_ids, flex_usable
from distlm.model.loss import chunked_head_loss, lm_loss
from distlm.model.moe import MoE, expert_width, inactive_params, is_moe_layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def sinusoid_table(length: int, dim: int, device=None) -> torch.Tensor:
    """The fixed table of 'Attention Is All You Need': sin on even, cos on odd columns."""
    pos = torch.arange(length, dtype=torch.float32, device=device)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return table


def sinusoid_scale(cfg: ModelConfig) -> float:
    """The sinusoid table's rows have norm sqrt(d/2), ~35x a GPT-2-initialised token
    embedding (element std init_std): added raw, position swamps token identity and a
    small model barely learns past unigram statistics (measured: loss stuck at 6.4 with a
    4k vocabulary). Scaled so its elements have RMS init_std, like GPT-2's learned table."""
    return cfg.init_std * math.sqrt(2.0)


def rope_tables(length: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate-half layout (pairs are (i, i + hd/2)), the convention Llama checkpoints use,
    # so export to LlamaForCausalLM needs no permutation. x: (B, T, H, hd).
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """QK-norm: each head's vector scaled to unit RMS, in fp32, x (B, T, H, hd). It bounds the
    attention logits, which otherwise grow with the weights and saturate the softmax.

    No learned gain. A gain would let each head learn its temperature, which here is
    bounded by |q.k|/sqrt(hd) <= sqrt(hd): 8 at hd=64, softmax weights up to e^16 apart,
    sharp enough to pick one token. And its gradient is a sum over heads, which tensor
    parallelism splits across ranks: it would need a reduction of its own."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


class Scalar(nn.Module):
    """One learned number multiplying its input: the weight of a U-net skip or of a value
    embedding. A module rather than a bare parameter so that tensor parallelism can say
    how its input is laid out (distlm.parallel.tp)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.scale.to(x.dtype)


class SoftcapLinear(nn.Linear):
    """The head with logit soft-capping: cap * tanh(z / cap), in fp32. Being the head
    itself, every path that produces logits (training, evaluation, generation, a pipeline's
    last stage, the vocabulary-parallel head) caps them; the chunked loss reads
    ``softcap`` and caps its chunks (distlm.model.loss)."""

    def __init__(self, d_in: int, d_out: int, softcap: float):
        super().__init__(d_in, d_out, bias=False)
        self.softcap = softcap

    def forward(self, x):
        return self.softcap * torch.tanh(super().forward(x).float() / self.softcap)


class AttentionOverride:
    """An attention mask that runs the attention itself: the blocks pass it where a mask goes
    (so their signatures, and the tensor-parallel plan that lays out their inputs, stay as
    they are), and ``Attention`` hands it q, k, v and the dropout probability. What a model
    holding only part of each row needs (distlm.parallel.context)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        raise NotImplementedError


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, value_embed: bool = False):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qk_norm = cfg.qk_norm
        self.norm_eps = cfg.norm_eps
        # Separate q/k/v projections: tensor parallelism can then shard each by columns
        # without interleaving heads of q, k and v.
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # Value embeddings: this block's values get ve_weight * (a token table's row).
        self.ve_weight = Scalar() if value_embed else None
        # One (d, 3d) matmul instead of three (d, d): measured faster on GPUs, where a
        # d=768 matmul is too narrow to fill the card. The weights are concatenated per
        # call (a few MB, against activations of tokens x 3d), so parameters, checkpoints
        # and the HF mapping keep the separate q/k/v. Tensor parallelism turns it off: it
        # shards q, k and v each by heads (distlm.parallel.tp).
        self.fused_qkv = True

    def qkv(self, x):
        if not self.fused_qkv:
            return self.wq(x), self.wk(x), self.wv(x)
        w = torch.cat((self.wq.weight, self.wk.weight, self.wv.weight))
        b = torch.cat((self.wq.bias, self.wk.bias, self.wv.bias)) if self.wq.bias is not None else None
        # A float8 layer (train.fp8) multiplies the concatenated weights in float8 too.
        linear = getattr(self.wq, "linear", F.linear)
        return linear(x, w, b).chunk(3, dim=-1)

    def project(self, x, rope=None, ve=None):
        """q, k, v as (B, H, T, hd): projected, values mixed with the value embedding ``ve``
        (B, T, H*hd), q and k normalised (qk_norm) and then rotated (rope)."""
        B, T, _ = x.shape
        # -1 for the head count: under TP each rank holds only its local heads (and ve
        # arrives as the matching slice of columns).
        q, k, v = (t.reshape(B, T, -1, self.head_dim) for t in self.qkv(x))
        if ve is not None:
            v = v + self.ve_weight(ve).reshape(v.shape)
        if self.qk_norm:
            q, k = head_rms_norm(q, self.norm_eps), head_rms_norm(k, self.norm_eps)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return tuple(t.transpose(1, 2) for t in (q, k, v))

    def forward(self, x, rope=None, cache=None, start_pos: int = 0, attn_mask=None, causal: bool = True, ve=None):
        B, T, _ = x.shape
        q, k, v = self.project(x, rope, ve)
        # attn_mask/causal come from the classifier (bidirectional, padding) or, for the LM,
        # from GPT.attention_mask (documents, windows); plain causal LM attention has neither.
        mask = attn_mask
        if cache is not None:
            k, v = cache.update(k, v, start_pos)
            if start_pos > 0:
                causal = False
                if T > 1 and mask is None:  # a chunk after a prefix: query i sees keys up to start_pos + i
                    mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(start_pos)
        dropout = self.dropout if self.training else 0.0
        y = mask(q, k, v, dropout) if isinstance(mask, AttentionOverride) else attend(q, k, v, mask, causal, dropout)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.wo(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, d_ff: int | None = None):
        super().__init__()
        d_ff = d_ff or cfg.d_ff  # another width: the shared experts of an MoE block
        self.swiglu = cfg.mlp == "swiglu"
        self.relu2 = cfg.mlp == "relu2"
        self.w_in = nn.Linear(cfg.d_model, d_ff, bias=cfg.bias)
        self.w_gate = nn.Linear(cfg.d_model, d_ff, bias=cfg.bias) if self.swiglu else None
        self.w_out = nn.Linear(d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        if self.swiglu:
            h = F.silu(self.w_gate(x)) * self.w_in(x)
        elif self.relu2:
            h = F.relu(self.w_in(x)).square()
        else:
            h = F.gelu(self.w_in(x), approximate="tanh")  # GPT-2's gelu
        return self.drop(self.w_out(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, value_embed=value_embed_table(cfg, layer) is not None)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg) if not is_moe_layer(cfg, layer) else \
            MoE(cfg, MLP(cfg, d_ff=cfg.moe.shared * expert_width(cfg)) if cfg.moe.shared else None)

    def forward(self, x, rope=None, cache=None, start_pos: int = 0, attn_mask=None, causal: bool = True,
                ve=None):
        # attn takes exactly these 7 positional inputs (the TP plan lays out the first).
        x = x + self.attn(self.attn_norm(x), rope, cache, start_pos, attn_mask, causal, ve)
        return x + self.mlp(self.mlp_norm(x))


def value_embed_table(cfg: ModelConfig, layer: int):
    """The value-embedding table block ``layer`` reads, or None: table i feeds block i and
    block n_layer-1-i, the first and last blocks sharing tables as a U-net shares levels."""
    n, L = cfg.value_embeds, cfg.n_layer
    if layer < n:
        return layer
    if layer >= L - n:
        return L - 1 - layer
    return None


def skip_source(cfg: ModelConfig, layer: int):
    """The block whose output is added into the input of block ``layer``, or None: block
    L-1-i receives block i's output for i < L//2 (an odd middle block receives none)."""
    L = cfg.n_layer
    if cfg.skip_connections and layer >= L - L // 2:
        return L - 1 - layer
    return None


def check_options(cfg: ModelConfig) -> None:
    """The model options that need more than their type to be valid."""
    if cfg.logit_softcap < 0:
        raise ConfigError(f"model.logit_softcap must be >= 0 (0 = off), got {cfg.logit_softcap}")
    if cfg.attn_window < 0:
        raise ConfigError(f"model.attn_window must be >= 0 (0 = off), got {cfg.attn_window}")
    if not 0 <= 2 * cfg.value_embeds <= cfg.n_layer:
        raise ConfigError(f"model.value_embeds={cfg.value_embeds}: each table feeds two blocks (the i-th from "
                          f"each end), so at most n_layer/2 = {cfg.n_layer // 2}")
    if cfg.dropout and (cfg.attn_mask != "causal" or cfg.attn_window):
        raise ConfigError(f"model.dropout={cfg.dropout} with model.attn_mask={cfg.attn_mask} / model.attn_window="
                          f"{cfg.attn_window}: FlexAttention has no attention dropout; set model.dropout=0")
    if cfg.eot_id is not None and cfg.vocab_size is not None and not 0 <= cfg.eot_id < cfg.vocab_size:
        raise ConfigError(f"model.eot_id={cfg.eot_id} is outside the vocabulary (0..{cfg.vocab_size - 1})")


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, padded_vocab). The loss lives outside (distlm.model.loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size must be set before building the model")
        check_options(cfg)
        self.cfg = cfg
        V = cfg.padded_vocab_size
        self.tok_emb = nn.Embedding(V, cfg.d_model)
        # Value embeddings: more token tables, read by the attention of the outer blocks.
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(V, cfg.d_model) for i in range(cfg.value_embeds)}) \
            if cfg.value_embeds else None
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        # A ModuleDict keyed "0".."L-1": pipeline stages delete the blocks they do not
        # own and the rest keep their fully-qualified names, so checkpoints stay layout-free.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})
        # U-net: the learned weight of each skip, keyed by the block it enters (see forward).
        self.skip_weights = nn.ModuleDict({str(i): Scalar() for i in range(cfg.n_layer)
                                           if skip_source(cfg, i) is not None}) if cfg.skip_connections else None
        # The methods compiled as regions of their own when the blocks are (see embed_tokens).
        self.compiled_regions = tuple(name for name, used in (("embed_tokens", cfg.value_embeds > 0),
                                                              ("add_skip", cfg.skip_connections)) if used)
        self.norm = make_norm(cfg)
        self.head = SoftcapLinear(cfg.d_model, V, cfg.logit_softcap) if cfg.logit_softcap \
            else nn.Linear(cfg.d_model, V, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        # moe.aux_loss: the MoE blocks whose auxiliary losses join the training loss.
        self.aux_losses = [m for m in self.modules() if isinstance(m, MoE)] if cfg.moe.aux_loss else []
        # Fixed tables are non-persistent buffers: derived from the config, never checkpointed.
        self.register_buffer("sinusoid", torch.empty(0), persistent=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def to_empty(self, *, device, recurse: bool = True):
        # nn.Module.to_empty allocates each parameter anew and so unties the head from
        # the embedding; tie them again.
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings and self.head is not None and self.tok_emb is not None:
            self.head.weight = self.tok_emb.weight
        return self

    @torch.no_grad()
    def init_buffers(self, device=None):
        cfg = self.cfg
        device = device or self.tok_emb.weight.device
        if cfg.position == "sinusoidal":
            self.sinusoid = sinusoid_table(cfg.block_size, cfg.d_model, device) * sinusoid_scale(cfg)
        elif cfg.position == "rope":
            self.rope_cos, self.rope_sin = rope_tables(cfg.block_size, cfg.head_dim, cfg.rope_theta, device)
        for m in self.modules():
            if isinstance(m, MoE):  # the routing biases start even (and not as to_empty's garbage)
                m.expert_bias.zero_()

    @torch.no_grad()
    def init_weights(self, seed: int = 0, device=None, threads: int | None = None):
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L), zero biases,
        unit norm weights. With model.zero_init_proj the two residual projections (attn.wo,
        mlp.w_out) start at zero instead, so every block starts as the identity; the
        scalar weights of skips and value embeddings start at one.

        Each parameter is drawn whole from its own generator, seeded by (seed, name), and
        each rank keeps only its shard of it. So the initial model is the same on one
        process, under DDP, FSDP2 or TP, which is what lets those layouts be compared to a
        single-process reference. Only one parameter at a time is ever whole. Called after
        ``to_empty`` when the model was built on the meta device. ``threads``: parameters
        drawn at once on the CPU (default: up to 8, as many as there are cores).

        The numbers are drawn where the parameters live. On a GPU that takes milliseconds
        where the CPU took seconds (gpt2-1.5b's 1.6B numbers: 7.6 s of a 2-GPU run's set-up),
        and the model is still the same on every layout of one kind of GPU. It is not the
        model a CPU run draws from the same seed: a GPU's generator is another stream (and
        its draws depend on how many multiprocessors share the work), so only runs on one
        kind of device start equal. A model whose shards are offloaded to host memory draws
        on the CPU.
        """
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        resid_proj = ("wo.weight", "w_out.weight", "experts.w_out")  # the last: an MoE block's experts

        def whole(name: str, p: torch.Tensor) -> torch.Tensor:
            leaf = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
            on = local_shard(p).device
            if leaf.endswith("bias") or (self.cfg.zero_init_proj and leaf.endswith(resid_proj)):
                return torch.zeros(p.shape, device=on)
            if leaf.endswith(("norm.weight", ".scale")):
                return torch.ones(p.shape, device=on)
            gen = torch.Generator(device=on).manual_seed(seed * 1_000_003 + zlib.crc32(leaf.encode()))
            s = resid_std if leaf.endswith(resid_proj) else std
            return torch.empty(p.shape, device=on).normal_(0.0, s, generator=gen)

        # Each parameter has its own generator, so drawing several at once (torch releases
        # the GIL) gives the same tensors as one at a time, in a fraction of the start-up:
        # one CPU thread draws about 170M numbers a second, and speedrun-124m has 278M
        # parameters, llama-7b 6.7B. At most `threads` parameters are whole at any moment.
        # On a GPU this thread queues the draws and the device runs them: other threads would
        # only hold more parameters whole at once (and run on their own current device and
        # stream), so the draws stay here.
        params = list(self.named_parameters())
        on_accelerator = any(local_shard(p).device.type != "cpu" for _, p in params)
        threads = 1 if on_accelerator else (threads or min(8, os.cpu_count() or 1))
        if threads == 1:
            for name, p in params:
                _copy_shard(p, whole(name, p))
        else:
            with ThreadPoolExecutor(threads) as pool:
                for start in range(0, len(params), threads):
                    chunk = params[start:start + threads]
                    for (_, p), full in zip(chunk, pool.map(lambda item: whole(*item), chunk)):
                        _copy_shard(p, full)
        self.init_buffers(device)

    def embed(self, idx: torch.Tensor, start_pos: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids -> the residual stream entering block 0 (positions added, dropout).
        ``positions`` (T,): the tokens' positions in their row, where they are not
        start_pos, start_pos + 1, ... (a part of each row, distlm.parallel.context)."""
        T = idx.shape[1]
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions if positions is not None
                                 else torch.arange(start_pos, start_pos + T, device=idx.device))
        elif self.cfg.position == "sinusoidal" and self.sinusoid.numel():
            table = self.sinusoid[positions] if positions is not None else self.sinusoid[start_pos:start_pos + T]
            x = x + table.to(x.dtype)
        return self.drop(x)

    # The work outside the blocks that the model's options add: the value embeddings' gathers
    # (and their backward: an eager scatter per table, each sorting the token ids anew) and the
    # U-net skips' mixing, element-wise passes over the (tokens x d) fp32 residual stream,
    # forward and backward. As methods of their own, a model compiled per block compiles each
    # as a small graph too (distlm.parallel.parallelize.apply_compile reads compiled_regions,
    # set in __init__). The head and the loss (head_loss) are compiled the same way. A plain
    # GPT's token and position lookups stay eager: two small gathers, not worth a compile.

    def embed_tokens(self, idx: torch.Tensor, start_pos: int = 0, positions: torch.Tensor | None = None):
        """Token ids -> (the residual stream entering block 0, the value embeddings: a list
        of (B, T, d) tensors, one per table, or None)."""
        x = self.embed(idx, start_pos, positions)
        ves = [emb(idx) for emb in self.value_embeds.values()] if self.value_embeds is not None else None
        return x, ves

    def add_skip(self, x: torch.Tensor, skip: torch.Tensor, gate: Scalar) -> torch.Tensor:
        """A U-net skip entering the residual stream: x + gate * skip. Every skip has the same
        shapes, so compiled it is one graph reused by all of them (the gate is an input)."""
        return x + gate(skip)

    def rope_at(self, start_pos: int, T: int, positions: torch.Tensor | None = None):
        if self.cfg.position != "rope":
            return None
        if positions is not None:
            return self.rope_cos[positions], self.rope_sin[positions]
        return self.rope_cos[start_pos:start_pos + T], self.rope_sin[start_pos:start_pos + T]

    def attention_mask(self, idx: torch.Tensor, start_pos: int = 0, cache=None, shard=None):
        """The keys each query may see, for every block of this forward (distlm.model.attention):
        None for plain causal attention, else a dense boolean mask or, on CUDA, a
        FlexAttention BlockMask. With a KV cache (generation) document boundaries are not
        applied: the context is taken as one document; the window is. With a ``shard`` (this
        rank holds part of each row) the shard's attention across ranks, under the same rule."""
        cfg = self.cfg
        if shard is not None:
            if cfg.attn_mask == "doc" and cfg.eot_id is None:
                raise ConfigError("model.attn_mask=doc needs model.eot_id, the end-of-text token id")
            return shard.attention(cfg.eot_id if cfg.attn_mask == "doc" else None, cfg.attn_window)
        if cfg.attn_mask == "causal" and not cfg.attn_window:
            return None
        B, T = idx.shape[:2]
        if cache is not None:
            if not cfg.attn_window:
                return None
            return dense_mask(T, start_pos + T, idx.device, start_pos, window=cfg.attn_window)
        docs = None
        if cfg.attn_mask == "doc":
            if cfg.eot_id is None:
                raise ConfigError("model.attn_mask=doc needs model.eot_id, the end-of-text token id (the "
                                  "tokenizer's; the training run takes it from the data)")
            docs = document_ids(idx, cfg.eot_id)
        if flex_usable(idx.device):
            return block_mask(docs, B if docs is not None else 1, T, cfg.attn_window, idx.device)
        return dense_mask(T, T, idx.device, docs=docs, window=cfg.attn_window)

    def forward(self, idx: torch.Tensor, cache=None, start_pos: int = 0, *,
                targets: torch.Tensor | None = None, shard=None) -> torch.Tensor:
        """Logits, or with ``targets`` the mean next-token loss: then the head and the loss
        run inside the forward, so a compiled or DDP/FSDP-wrapped model fuses or hooks
        them with the rest (see head_loss). ``shard``: where ``idx``'s tokens sit in rows
        split across ranks (distlm.parallel.context.SequenceShard): their positions, and
        the attention that reaches the other ranks' keys."""
        positions = shard.positions if shard is not None else None
        # A part without tok_emb (a pipeline stage) takes the residual stream as input; it has
        # no value embeddings (config validation: they need the token ids).
        x, ves = self.embed_tokens(idx, start_pos, positions) if self.tok_emb is not None else (idx, None)
        rope = self.rope_at(start_pos, idx.shape[1], positions)
        mask = self.attention_mask(idx, start_pos, cache, shard)
        skips = []  # U-net: outputs of the first half's blocks, last in first out
        for i, block in self.blocks.items():
            layer = int(i)
            table = value_embed_table(self.cfg, layer) if ves is not None else None
            if skip_source(self.cfg, layer) is not None:
                # Added here, not inside the block: a block compiled on its own then has one
                # graph per kind of input (value embedding or not) instead of four (and a
                # fifth for the middle block, whose skip is its own input). The gates are
                # the root's parameters, which FSDP2 gathers for this whole forward.
                # A view: the first skip's source is also x (block L/2 - 1's output, L even),
                # and the same tensor passed twice would be a second compiled graph. The view
                # costs no kernel; the two gradients it splits are summed as the others are.
                skip = skips.pop()
                x = self.add_skip(x, skip.view_as(skip), self.skip_weights[i])
            x = block(x, rope, cache.layer(layer) if cache is not None else None, start_pos, mask, True,
                      ves[table] if table is not None else None)
            if self.cfg.skip_connections and layer < self.cfg.n_layer // 2:
                skips.append(x)
        if targets is not None:
            loss = self.head_loss(x, targets)
            if self.training and self.aux_losses:
                loss = loss + sum(m.aux_loss for m in self.aux_losses)
            return loss
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, head, mean cross-entropy. With model.loss_chunk the logits are built
        a chunk of tokens at a time and never whole (distlm.model.loss)."""
        x = self.norm(x)
        if self.cfg.loss_chunk:
            return chunked_head_loss(x, self.head.weight, targets, self.cfg.loss_chunk, self.cfg.logit_softcap)
        return lm_loss(self.head(x), targets)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters without padding rows. non_embedding drops token/position tables
        but keeps the (possibly tied) head, as in the FLOPs formula 6N."""
        cfg = self.cfg
        n = sum(p.numel() for p in self.parameters())
        pad_rows = cfg.padded_vocab_size - cfg.vocab_size
        n -= pad_rows * cfg.d_model * ((1 if cfg.tie_embeddings else 2) + cfg.value_embeds)
        if non_embedding:
            n -= cfg.value_embeds * cfg.vocab_size * cfg.d_model  # lookups, like the input table
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
            if not cfg.tie_embeddings:
                n -= cfg.vocab_size * cfg.d_model  # the input table; the head stays
        return n


def count_params(cfg: ModelConfig, non_embedding: bool = True) -> int:
    """num_params of the whole model, built on the meta device (a pipeline rank holds a part)."""
    with torch.device("meta"):
        return GPT(cfg).num_params(non_embedding)


def _copy_shard(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into p its own piece of the whole tensor ``full`` (p may be a DTensor)."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
        local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        p.to_local().copy_(local)
    else:
        p.copy_(full)


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """6N + 12*L*d*T (PaLM appendix B): matmul FLOPs of forward+backward per token,
    attention scores included, no causal halving. N = non-embedding params + head, and of
    a mixture of experts only the active ones: each token runs k of the E routed experts
    (the router and the shared experts count whole)."""
    return 6 * (n_params - inactive_params(cfg)) + 12 * cfg.n_layer * cfg.d_model * cfg.block_size
