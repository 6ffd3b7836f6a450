"""A small GPT on bytes of text, and the LightningModule that trains it to predict the next byte and writes text in
predict. The worked example of a model that is not about images: `python train.py experiment=gpt_text`.

The net is nanoGPT's (Karpathy): token and position embeddings, `n_layer` transformer blocks of causal
self-attention and an MLP, a final LayerNorm and a linear head over the 256 byte values. Bytes, not a vocabulary
learned from the data: any text file trains it and predict takes any prompt.
"""

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
VOCAB = 256  # byte values


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: Tensor) -> Tensor:
        batch, steps, channels = x.shape
        heads = (batch, steps, self.n_head, channels // self.n_head)
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = q.view(heads).transpose(1, 2), k.view(heads).transpose(1, 2), v.view(heads).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, steps, channels))


class Block(nn.Module):
    """One transformer block: where pipe and pipeline cut (split_points=[blocks.2]) and what fsdp shards as a unit."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Bytes (N, T) -> logits of the next byte at every position (N, T, 256); T at most `block_size`."""

    def __init__(
        self, block_size: int = 64, n_layer: int = 4, n_head: int = 4, n_embd: int = 64, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if min(block_size, n_layer, n_head, n_embd) < 1:
            raise ValueError(f"sizes must be >= 1: {block_size}, {n_layer}, {n_head}, {n_embd}")
        self.block_size = block_size
        self.token = nn.Embedding(VOCAB, n_embd)
        self.position = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        steps = idx.shape[1]
        assert steps <= self.block_size, f"a sequence of {steps} bytes, longer than block_size={self.block_size}"
        x = self.drop(self.token(idx) + self.position(torch.arange(steps, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class LanguageModel(L.LightningModule):
    """Trains `net` to predict each next byte (cross-entropy); in predict, continues each prompt by
    `max_new_tokens` bytes sampled at `temperature` from the `top_k` likeliest."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 40,
    ) -> None:
        super().__init__()
        if max_new_tokens < 0 or temperature <= 0 or (top_k is not None and top_k < 1):
            raise ValueError(
                f"need max_new_tokens >= 0, temperature > 0, top_k >= 1: {max_new_tokens}, {temperature}, {top_k}"
            )
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
        self.example_input_array = torch.zeros(2, getattr(net, "block_size", 8), dtype=torch.long)

    def forward(self, idx: Tensor) -> Tensor:
        return self.net(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss.detach())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test/loss", self._loss(batch), sync_dist=True)

    @torch.no_grad()
    def generate(self, idx: Tensor) -> Tensor:
        """`idx` (N, T) continued by max_new_tokens sampled bytes, each from the last block_size before it."""
        block_size = getattr(self.net, "block_size", idx.shape[1])
        for _ in range(self.max_new_tokens):
            logits = self(idx[:, -block_size:])[:, -1, :] / self.temperature
            if self.top_k is not None:
                kth = torch.topk(logits, min(self.top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), num_samples=1)], dim=1)
        return idx

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        """Each prompt of `batch["input"]` (bytes) and what the model writes after it, as text."""
        prompts = batch["input"]
        written = self.generate(prompts)[:, prompts.shape[1] :]
        return [bytes(row.tolist()).decode("utf-8", errors="replace") for row in written]

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer)}}
