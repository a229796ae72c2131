"""A DLRM (Naumov et al. 2019) and a synthetic Criteo-like data generator.

One file, plain PyTorch: a bottom MLP over the dense features, one ``nn.EmbeddingBag`` per
categorical feature (sum-pooled bags of ids, multi-hot), the pairwise dot-product interaction of
the dense vector and the pooled embeddings, a top MLP and binary cross-entropy on the click label.

The categorical features come as the reference DLRM code passes them (``dlrm_s_pytorch.py``'s
``lS_i`` / ``lS_o``): per feature, a 1-D tensor of ids (every sample's bag, one after the other)
and a 1-D tensor of ``batch`` offsets where each sample's bag starts. ``forward`` takes
``(dense, ids_0, offsets_0, ids_1, offsets_1, ..., labels)``; :func:`batch` returns that tuple
and :func:`batch_dict` the same as keywords. The ids of one step are *jagged*: the bags differ in
length, so a sample's ids are found through the offsets, not by position.

The generator draws ids from a Zipf distribution per feature (rank ``k`` with probability
``~ 1/k^a``, shuffled so that hot rows are spread over the table), bag lengths from
``1..max_hots``, and labels from a fixed logistic model of the dense features and a few hot ids,
so that a trained model has something to learn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class DLRMConfig:
    """Model shape. The defaults are a small model for tests; :func:`criteo_like` gives table
    sizes spanning 10^3..10^7 rows like Criteo's 26 features."""

    num_dense: int = 13
    table_rows: tuple[int, ...] = (1000, 200, 5000, 50)
    embedding_dim: int = 16
    bottom: tuple[int, ...] = (32,)
    top: tuple[int, ...] = (32, 16)
    mode: str = "sum"
    max_hots: tuple[int, ...] = (3, 1, 4, 2)  # the longest bag per feature (1: one-hot)
    zipf: float = 1.1  # the exponent of the ids' popularity
    per_sample_weights: bool = False  # weighted bags (mode "sum" only)

    def __post_init__(self):
        if len(self.max_hots) != len(self.table_rows):
            raise ValueError(f"DLRMConfig: max_hots has {len(self.max_hots)} entries for "
                             f"{len(self.table_rows)} tables")


def criteo_like(embedding_dim: int = 64, scale: float = 1.0) -> DLRMConfig:
    """26 tables whose sizes span 10^3..10^7 rows (times ``scale``), as Criteo's categorical
    features do, with multi-hot bags of up to 1..8 ids (DLRM-DCNv2's synthetic multi-hot)."""
    sizes = [10 ** (3 + 4 * i / 25) for i in range(26)]
    rows = tuple(max(4, int(s * scale)) for s in sizes)
    hots = tuple(1 + (i * 5) % 8 for i in range(26))
    return DLRMConfig(table_rows=rows, embedding_dim=embedding_dim, bottom=(512, 256, embedding_dim),
                      top=(1024, 1024, 512, 256), max_hots=hots)


def _mlp(sizes: list[int], last_plain: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if not (last_plain and i == len(sizes) - 2):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embedding bags, dot interaction, top MLP; ``forward`` returns the mean binary
    cross-entropy of the click logits."""

    def __init__(self, config: DLRMConfig = DLRMConfig()):
        super().__init__()
        self.config = config
        d = config.embedding_dim
        self.bottom = _mlp([config.num_dense, *config.bottom, d], last_plain=False)
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, d, mode=config.mode) for rows in config.table_rows)
        n = len(config.table_rows) + 1
        self.top = _mlp([d + n * (n - 1) // 2, *config.top, 1], last_plain=True)
        self._pairs = torch.triu_indices(n, n, offset=1)

    def forward(self, dense: torch.Tensor, *sparse_and_labels: torch.Tensor) -> torch.Tensor:
        *sparse, labels = sparse_and_labels
        step = 3 if self.config.per_sample_weights else 2
        x = self.bottom(dense)
        pooled = [x]
        for t, table in enumerate(self.tables):
            ids, offsets = sparse[step * t], sparse[step * t + 1]
            weights = sparse[step * t + 2] if self.config.per_sample_weights else None
            pooled.append(table(ids, offsets, per_sample_weights=weights))
        z = torch.stack(pooled, dim=1)  # [batch, features + 1, d]
        dots = torch.bmm(z, z.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        logits = self.top(torch.cat([x, dots], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, labels)


@dataclass
class CriteoLike:
    """A stream of synthetic Criteo-like batches for ``config``, reproducible from ``seed``."""

    config: DLRMConfig
    seed: int = 0
    _perms: list[torch.Tensor] = field(init=False, repr=False)
    _cdfs: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self._perms, self._cdfs = [], []
        for rows in self.config.table_rows:
            # Zipf over the first min(rows, 10^5) popularity ranks (the tail beyond is too rare to
            # matter for a sample of batches), mapped to rows by a fixed random permutation
            ranks = min(rows, 100_000)
            p = 1.0 / torch.arange(1, ranks + 1, dtype=torch.float64) ** self.config.zipf
            self._cdfs.append(torch.cumsum(p / p.sum(), 0))
            self._perms.append(torch.randperm(rows, generator=g)[:ranks])
        self._generator = torch.Generator().manual_seed(self.seed + 1)

    def ids(self, table: int, n: int) -> torch.Tensor:
        """``n`` ids of ``table``, Zipf-distributed."""
        u = torch.rand(n, generator=self._generator, dtype=torch.float64)
        ranks = torch.searchsorted(self._cdfs[table], u).clamp(max=len(self._cdfs[table]) - 1)
        return self._perms[table][ranks]

    def batch(self, size: int) -> tuple[torch.Tensor, ...]:
        """``(dense, ids_0, offsets_0, ..., labels)`` for ``size`` samples."""
        g, c = self._generator, self.config
        dense = torch.rand(size, c.num_dense, generator=g).log1p()  # Criteo's log(1 + count) transform
        sparse: list[torch.Tensor] = []
        signal = dense[:, 0] - dense[:, 1]
        for t, hots in enumerate(c.max_hots):
            lengths = torch.randint(1, hots + 1, (size,), generator=g)
            ids = self.ids(t, int(lengths.sum()))
            offsets = torch.cumsum(lengths, 0) - lengths
            sparse += [ids, offsets]
            if c.per_sample_weights:
                sparse.append(torch.rand(len(ids), generator=g))
            first = ids[offsets]
            signal = signal + 0.5 * (first % 2 == 0).float()  # an id's parity: learnable from its row
        labels = torch.bernoulli(torch.sigmoid(signal - signal.mean()), generator=g)
        return (dense, *sparse, labels)

    def batch_dict(self, size: int) -> dict[str, torch.Tensor]:
        """The same batch as keywords: ``dense``, ``ids_<t>``, ``offsets_<t>`` (``weights_<t>``),
        ``labels``."""
        values = self.batch(size)
        keys = ["dense"]
        for t in range(len(self.config.table_rows)):
            keys += [f"ids_{t}", f"offsets_{t}"] + ([f"weights_{t}"] if self.config.per_sample_weights else [])
        return dict(zip([*keys, "labels"], values))
