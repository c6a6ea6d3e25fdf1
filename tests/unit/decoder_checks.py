"""A check the fast decoders' tests share: speculative sampling's extend-then-rewind."""

from __future__ import annotations

import torch


def check_extend_then_rewind(decoder, fed: torch.Tensor, start: torch.Tensor, expected: torch.Tensor) -> None:
    """Round 1 feeds 4 tokens per row (of `fed [4, 8]`, after each row's prompt ending at `start - 1`)
    and rows keep 1, 4, 2, 3 of them; round 2 feeds each row's next 4 tokens. Both rounds' logits
    must be `expected [4, 8, V]` (those of the whole sequences) at the columns fed, to 1e-5."""
    got = decoder.extend(fed[:, :4], start.unsqueeze(1) + torch.arange(4))
    torch.testing.assert_close(got, expected[:, :4], atol=1e-5, rtol=0)
    kept = torch.tensor([1, 4, 2, 3])
    decoder.rewind(4 - kept)
    columns = kept.unsqueeze(1) + torch.arange(4)
    got = decoder.extend(fed.gather(1, columns), start.unsqueeze(1) + columns)
    torch.testing.assert_close(got, expected.gather(1, columns.unsqueeze(2).expand(-1, -1, got.shape[2])),
                               atol=1e-5, rtol=0)
