"""A text project written the way users write one: a character-level GPT exactly as nanoGPT writes it (an assert on
the sequence length in forward, attention through scaled_dot_product_attention, weight tying), its own
LightningModule, and its own LightningDataModule over a text that ships with Python (pydoc's topics), with a
vocabulary it learns. Plain DataLoaders. Nothing here knows the template."""

import math

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        block_size: int = 32,
        n_layer: int = 4,
        n_head: int = 2,
        n_embd: int = 32,
        tie_weights: bool = True,
    ):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class CharGPT(L.LightningModule):
    def __init__(
        self, vocab_size: int = 96, block_size: int = 32, n_layer: int = 4, lr: float = 3e-3, tie_weights: bool = True
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, tie_weights=tie_weights)
        self.example_input_array = torch.zeros(2, block_size, dtype=torch.long)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Windows(Dataset):
    """Non-overlapping windows of `block_size` characters and, shifted by one, the characters that follow."""

    def __init__(self, data: Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class PydocText(L.LightningDataModule):
    """The first `chars` characters of the Python documentation's topics, a vocabulary learned from them."""

    def __init__(self, block_size: int = 32, batch_size: int = 16, chars: int = 20000, shuffle: bool = True) -> None:
        super().__init__()
        self.block_size, self.batch_size, self.chars, self.shuffle = block_size, batch_size, chars, shuffle

    def setup(self, stage: str) -> None:
        from pydoc_data.topics import topics

        text = "\n".join(topics[k] for k in sorted(topics))[: self.chars]
        self.vocab = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.vocab)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(data))
        self.train_set, self.val_set = Windows(data[:n], self.block_size), Windows(data[n:], self.block_size)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return self.val_dataloader()
