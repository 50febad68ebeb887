"""The scenario models and their deterministic synthetic data; the dtypes a scenario may use."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scenarios.spec.seeds import data_generator

# Five small models, each with deterministic synthetic data that is a function of
# (seed, rank, step, micro-batch) alone, so a golden run and every trial see the same
# batches in every process, and the guard's replay audit can recompute a neighbour's batch.
MODEL_KINDS = ("mlp", "cnn", "cnn_bn", "transformer", "llama")
"""Model names accepted by scenario files (``[model] kind = ...``)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Parameter and activation dtypes accepted by scenario files (``dtype = ...``)."""

_MLP_IN, _CLASSES = 16, 4
_IMAGE = 12
_VOCAB, _SEQ = 16, 12
_LLAMA_HEADS, _LLAMA_KV_HEADS = 4, 2
_LLAMA_HIDDEN_MULTIPLE = 32
_ROPE_THETA = 10_000.0


class MLP(nn.Module):
    """``depth`` hidden ReLU layers of ``width`` units; 16 inputs, 4 classes."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = _MLP_IN
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        layers.append(nn.Linear(d, _CLASSES))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.net(x)
        return y


class GlobalAvgPool(nn.Module):
    """Mean over the spatial dimensions. (``AdaptiveAvgPool2d`` has no deterministic CUDA
    backward, and the replay audit runs with ``torch.use_deterministic_algorithms(True)``.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


class SmallCNN(nn.Module):
    """Two 3x3 convolutions (optionally each followed by BatchNorm), pooling, a linear head."""

    def __init__(self, width: int, batchnorm: bool) -> None:
        super().__init__()

        def norm(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if batchnorm else nn.Identity()

        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.norm1 = norm(width)
        self.act1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.norm2 = norm(2 * width)
        self.act2 = nn.ReLU()
        self.gap = GlobalAvgPool()
        self.head = nn.Linear(2 * width, _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.act1(self.norm1(self.conv1(x))))
        h = self.gap(self.act2(self.norm2(self.conv2(h))))
        y: torch.Tensor = self.head(h)
        return y


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y: torch.Tensor = self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return y


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        y: torch.Tensor = x + self.out(self.act(self.fc(self.ln2(x))))
        return y


class TinyGPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, ``depth`` pre-norm blocks."""

    def __init__(self, width: int, depth: int, heads: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(_VOCAB, width)
        self.pos = nn.Embedding(_SEQ, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, _VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        y: torch.Tensor = self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(pos))))
        return y


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary position embeddings on q and k, grouped-query
    (``kv_heads`` key/value heads shared by ``heads // kv_heads`` query heads each), no biases.

    Every projection is an ``nn.Linear`` (the checksum check and the ``linear_product`` site
    see them all). Scores use the same explicit masked softmax as ``TinyGPT``: one computation
    on every backend, deterministic forward and backward on the CPU. The rotation tables are
    non-persistent buffers of the attention itself (not arguments of a block), so they stay out
    of checkpoints and FSDP2's mixed precision never casts them (``model.to(dtype)`` does, as
    it casts every floating buffer); the rotation runs in float32 whatever the model's dtype.
    """

    def __init__(self, d: int, heads: int, kv_heads: int, max_seq: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.wq = nn.Linear(d, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, d, bias=False)
        half = self.head_dim // 2
        inv_freq = _ROPE_THETA ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def rotate(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` (batch, heads, time, head_dim) with each pair of features (2i, 2i+1) at
        position p turned by the angle p * theta**(-2i/head_dim), computed in float32."""
        t = z.shape[2]
        cos, sin = self.rope_cos[:t].float(), self.rope_sin[:t].float()
        pairs = z.float().reshape(*z.shape[:-1], -1, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return turned.flatten(-2).to(z.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q), self.rotate(k)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y: torch.Tensor = self.wo((att @ v).transpose(1, 2).reshape(b, t, -1))
        return y


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.act = nn.SiLU()
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.w2(self.act(self.w1(x)) * self.w3(x))
        return y


class LlamaBlock(nn.Module):
    """Pre-norm residual block: RMSNorm -> rotary attention, RMSNorm -> SwiGLU."""

    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int, max_seq: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(d, eps=1e-5)
        self.attention = RotaryAttention(d, heads, kv_heads, max_seq)
        self.ffn_norm = nn.RMSNorm(d, eps=1e-5)
        self.feed_forward = SwiGLU(d, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        y: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return y


def swiglu_hidden(width: int, multiple: int = _LLAMA_HIDDEN_MULTIPLE) -> int:
    """The SwiGLU hidden size: 2/3 of 4 * ``width`` (the parameters of a 4x GELU MLP),
    rounded up to a multiple of ``multiple`` (64 -> 192)."""
    return multiple * math.ceil(int(2 * 4 * width / 3) / multiple)


class TinyLlama(nn.Module):
    """A Llama-style decoder (the shape of torchtitan's debug model, much smaller): token
    embedding, ``depth`` blocks of RMSNorm + rotary grouped-query attention and RMSNorm +
    SwiGLU, a final RMSNorm and an untied output projection; no biases anywhere.

    ``heads`` query heads and ``kv_heads`` key/value heads: ``width`` must be a multiple of
    ``heads`` with an even head size (rotary embeddings turn pairs of features), and
    ``kv_heads`` must divide ``heads``. Initialised as torchtitan's Llama: embeddings N(0, 1),
    projections truncated N(0, 0.02), the projections that write into the residual stream
    (``wo``, ``w2``) scaled down by sqrt(2 * depth), the output by width**-0.5.
    """

    def __init__(self, width: int, depth: int, heads: int = _LLAMA_HEADS,
                 kv_heads: int = _LLAMA_KV_HEADS) -> None:
        super().__init__()
        if width % heads or (width // heads) % 2:
            raise ValueError(f"llama width must be a multiple of {2 * heads} ({heads} heads of "
                             f"an even size, for the rotary embeddings), got {width}; use e.g. "
                             f"{max(2 * heads, width - width % (2 * heads))}.")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"llama kv_heads must divide heads={heads}, got {kv_heads}.")
        self.tok_embeddings = nn.Embedding(_VOCAB, width)
        self.blocks = nn.Sequential(*(LlamaBlock(width, heads, kv_heads, swiglu_hidden(width),
                                                 _SEQ) for _ in range(depth)))
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.output = nn.Linear(width, _VOCAB, bias=False)
        self._init_weights(width, depth)

    def _init_weights(self, width: int, depth: int) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        residual_std = 0.02 / math.sqrt(2 * depth)
        for name, m in self.blocks.named_modules():
            if isinstance(m, nn.Linear):
                std = residual_std if name.endswith((".wo", ".w2")) else 0.02
                nn.init.trunc_normal_(m.weight, std=std, a=-3 * std, b=3 * std)
        std = width ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.output(self.norm(self.blocks(self.tok_embeddings(idx))))
        return y


def build_model(kind: str, *, width: int, depth: int, seed: int) -> nn.Module:
    """A freshly initialised model of ``kind``; the same weights for the same seed everywhere."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(width, depth)
    if kind in ("cnn", "cnn_bn"):
        return SmallCNN(width, batchnorm=kind == "cnn_bn")
    if kind == "transformer":
        if width % 2:
            raise ValueError(f"transformer width must be even (2 heads), got {width}.")
        return TinyGPT(width, depth)
    if kind == "llama":
        return TinyLlama(width, depth)
    raise ValueError(f"unknown model kind {kind!r}; use one of {list(MODEL_KINDS)}.")


def synthetic_batch(
    kind: str, seed: int, rank: int, step: int, micro: int, *, batch: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of one micro-batch: a pure function of its arguments.

    Labels come from a fixed rule, so the loss falls as the model learns: the MLP's
    from a random linear teacher (seeded by ``seed``), the CNN's from the brightest
    image quadrant, the transformer's and the llama's from arithmetic sequences (next
    token = previous + a per-sequence stride, mod the vocabulary).
    """
    g = data_generator(seed, rank, step, micro)
    if kind == "mlp":
        x = torch.randn(batch, _MLP_IN, generator=g)
        teacher = torch.randn(_MLP_IN, _CLASSES, generator=torch.Generator().manual_seed(seed))
        return x.to(dtype), (x @ teacher).argmax(dim=1)
    if kind in ("cnn", "cnn_bn"):
        x = torch.randn(batch, 1, _IMAGE, _IMAGE, generator=g)
        h = _IMAGE // 2
        quads = torch.stack([x[:, 0, :h, :h].sum((1, 2)), x[:, 0, :h, h:].sum((1, 2)),
                             x[:, 0, h:, :h].sum((1, 2)), x[:, 0, h:, h:].sum((1, 2))], dim=1)
        return x.to(dtype), quads.argmax(dim=1)
    if kind in ("transformer", "llama"):
        start = torch.randint(0, _VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(_SEQ + 1)) % _VOCAB
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    raise ValueError(f"unknown model kind {kind!r}; use one of {list(MODEL_KINDS)}.")


def scenario_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy in float32 (also for bfloat16 models); sequence models over every position."""
    x, y = batch
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def activation_targets(model: nn.Module) -> list[str]:
    """Module names whose forward output is one Tensor: leaf modules that compute something."""
    skip = (nn.Identity, nn.Dropout)
    return [n for n, m in model.named_modules()
            if n and not list(m.children()) and not isinstance(m, skip)]


def linear_targets(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules (targets of the ``linear_product`` site)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def parameter_targets(model: nn.Module) -> list[str]:
    """Names of the trainable parameters (targets of the gradient, state and weight sites)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]
