"""Deterministic synthetic data: a seeded token stream, identical for ON and OFF."""

from __future__ import annotations

import torch


def batch(seed: int, step: int, dp_rank: int, micro_batch: int, seq_len: int, vocab: int, device="cpu",
          microbatch: int = 0):
    """Tokens and next-token labels for one (step, data-parallel rank, microbatch); drawn on the
    CPU. Microbatch 0 is the stream a one-microbatch run has always drawn."""
    g = torch.Generator().manual_seed(seed * 7919 + step * 104_729 + dp_rank * 1_299_709
                                      + microbatch * 15_485_863)
    ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)
