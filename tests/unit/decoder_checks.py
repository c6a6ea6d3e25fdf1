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


def steps_beside_the_forward(engine, ours, theirs, ids: torch.Tensor, lengths: torch.Tensor,
                             tokens: torch.Tensor, drop_rows_at: int) -> list[tuple]:
    """Decoder `ours` and the model-forward decoder `theirs`, both prefilled by `engine` with the
    prompts `ids` (right-padded, `lengths`), fed `tokens [steps, 4]` one step at a time; rows 1 and
    3 are dropped before step `drop_rows_at`: `[(ours, our logits, their logits)]` per step."""
    steps = []
    with torch.inference_mode():
        _, positions = engine._prefill(ids, lengths, ours, capacity=ids.shape[1] + tokens.shape[0])
        engine._prefill(ids, lengths, theirs, capacity=0)
        for step in range(tokens.shape[0]):
            if step == drop_rows_at:
                keep = torch.tensor([0, 2])
                ours.keep_rows(keep)
                theirs.keep_rows(keep)
                positions, tokens = positions[keep], tokens[:, keep]
            steps.append((ours, ours.step(tokens[step], positions), theirs.step(tokens[step], positions)))
            positions = positions + 1
    return steps
