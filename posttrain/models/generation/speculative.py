"""Speculative sampling for `NativeGenerationEngine` (`policy.generation.speculative`).

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): a cheap drafter proposes the next k tokens of each row, one policy forward scores the
row's last token and all k drafts at once (`decoder.extend`), and the row keeps the drafts the
policy agrees with plus one token of the policy's own, so one forward can emit up to k + 1 tokens.

The rule, and why the tokens are exactly the policy's. The drafts here are deterministic (greedy
or looked up): the draft distribution q is one-hot on the drafted token x. The standard rule
accepts x with probability min(1, p(x) / q(x)) = p(x), and on rejection samples from the
residual max(0, p - q) renormalised, which for a one-hot q is p restricted to the tokens != x.
The engine implements that rule by coupling it to plain decoding: at drafted position t it draws
the policy's own token y_t from exactly the random stream plain decoding would use at that step
(`sampling.sample` with the row's seed and step counter, from the processed logits of the
verification forward) and accepts x iff y_t == x, which has probability p(x); on a mismatch it
emits y_t, whose law given y_t != x is the residual, and drops the drafts after it. If all drafts
are accepted, the token after them is drawn the same way (the "bonus" token). Greedy decoding is
the special case y_t = argmax. So a row emits, for a given seed, the very tokens plain decoding
emits (up to the float rounding of a multi-token forward against one-token forwards), whatever
the drafts: per-row seeds, batch independence and partial rollouts' `start_steps` stay exact,
and a bad drafter costs speed, never correctness. The logprobs handed to training are the
policy's processed logprobs of the emitted tokens, from the verification forward. Stop tokens,
stop strings and `max_new_tokens` end a row at the same token as plain decoding: emitted tokens
are checked one by one, and no row drafts beyond its budget.

Drafters (`make_drafter`):

- `NgramDrafter`: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"): the tokens
  that followed the latest earlier occurrence of the context's last n tokens (prompt and
  generated so far), n from `ngram_size` down to `ngram_min_size`. No model, a few tensor ops.
- `DraftModelDrafter`: greedy drafts of a small model that shares the policy's tokenizer, with
  its own KV cache kept in step with the accepted tokens.
- `EarlyExitDrafter`: greedy drafts of the policy's own first `num_layers` layers, through its
  final norm and output head (self-speculation: Zhang et al. 2024, "Draft & Verify"; Elhoushi et
  al. 2024, "LayerSkip"). It shares the policy's KV cache: the first layers' keys and values of
  a drafted token are exactly those the full forward writes, and the verification forward
  overwrites them at the same columns. A model not trained to exit early drafts poorly.

Cost. A verification forward feeds 1 + k tokens per row: on a GPU at small batch, where a
forward costs about the time to read the weights, that is nearly free; on a CPU, or at large
batch, the matmuls grow with the tokens fed, and speculation pays only when enough drafts are
accepted (benchmarks/speculative.py prints both). Each row's counts are returned with the outputs
(`SPECULATIVE_COUNTS`) and the rollouts log acceptance rate and tokens per forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from posttrain.models.generation.decoders import LlamaLikeDecoder
from posttrain.models.generation.sampling import process_logits, sample

# Per-row counts in a speculative generation's outputs: drafted tokens, drafted tokens emitted,
# and policy forwards the row took part in (its prefill included, so plain decoding's tokens per
# forward is exactly 1).
SPECULATIVE_COUNTS = ("speculative_draft_tokens", "speculative_accepted_tokens", "speculative_forwards")


class Drafter:
    """Proposes up to `num_draft_tokens` tokens for each row of the engine's decoder batch.

    The engine calls `start` after the policy's prefill, then per verification round `propose`
    and, after the policy's check, `update`; `keep_rows` when it drops finished rows, `release`
    at the end.
    """

    def __init__(self, num_draft_tokens: int):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens

    def start(self, decoder: Any, input_ids: torch.Tensor, input_lengths: torch.Tensor, capacity: int) -> None:
        """A generation of the right-padded prompts begins; `decoder` holds the policy's cache."""

    def propose(
        self, history: torch.Tensor, lengths: torch.Tensor, limits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for each row.

        Args:
            history: `[rows, C]` each row's context (prompt, then generated tokens) from column 0.
            lengths: `[rows]` context length: the last column is the token fed next.
            limits: `[rows]` drafts allowed per row (0: none, e.g. a finished row).

        Returns:
            `(drafts [rows, k'], counts [rows])`: row r's drafts are `drafts[r, :counts[r]]`,
            `counts <= limits`.
        """
        raise NotImplementedError

    def update(self, accepted: torch.Tensor) -> None:
        """The policy kept the first `accepted [rows]` drafts of each row (and emitted one token after them)."""

    def keep_rows(self, keep: torch.Tensor) -> None:
        """The engine keeps only its decoder rows `keep`."""

    def release(self) -> None:
        """The generation ended."""


class NgramDrafter(Drafter):
    """Prompt lookup decoding: the tokens that followed the latest earlier occurrence of the
    context's last n tokens, for the largest n in [`min_size`, `max_size`] that occurs earlier."""

    def __init__(self, num_draft_tokens: int, max_size: int = 3, min_size: int = 1):
        super().__init__(num_draft_tokens)
        if not 1 <= min_size <= max_size:
            raise ValueError(f"need 1 <= ngram_min_size <= ngram_size, got {min_size} and {max_size}")
        self.max_size, self.min_size = max_size, min_size

    def propose(self, history, lengths, limits):
        rows, width = history.shape
        device = history.device
        follow = torch.full((rows,), -1, dtype=torch.long, device=device)  # column of the first proposed token
        for n in range(self.max_size, self.min_size - 1, -1):
            need = ((follow < 0) & (lengths > n) & (limits > 0)).nonzero().squeeze(1)
            if need.numel() == 0:
                continue
            context, length = history[need], lengths[need]
            suffix = context.gather(1, (length - n).unsqueeze(1) + torch.arange(n, device=device))
            match = (context.unfold(1, n, 1) == suffix.unsqueeze(1)).all(-1)  # [r, width - n + 1]
            # An earlier occurrence starts before the suffix does, so a token follows it in the context.
            starts = torch.arange(width - n + 1, device=device)
            match &= starts < (length - n).unsqueeze(1)
            latest = torch.where(match, starts, -1).max(dim=1).values
            follow[need] = torch.where(latest >= 0, latest + n, -1)
        found = follow >= 0
        counts = torch.where(found, torch.minimum(limits, lengths - follow), 0).clamp(max=self.num_draft_tokens)
        columns = (follow.clamp(min=0).unsqueeze(1) + torch.arange(self.num_draft_tokens, device=device))
        return history.gather(1, columns.clamp(max=width - 1)), counts


class DraftModelDrafter(Drafter):
    """Greedy drafts of a small model sharing the policy's tokenizer, decoded by its own engine
    (`draft_engine`, a `NativeGenerationEngine`: its prefill and decoder, its own KV cache). The draft
    cache holds each row's context up to `cached`; the tokens after it (the policy's last token,
    and the last draft when all were accepted) are fed at the start of the next round."""

    def __init__(self, draft_engine: Any, num_draft_tokens: int):
        super().__init__(num_draft_tokens)
        self.draft_engine = draft_engine
        self.decoder = None
        self.cached: Optional[torch.Tensor] = None  # [rows] context tokens in the draft's cache
        self.uncommitted = 0  # drafts fed to the draft model this round (all but the last)
        self.vocab_size = 0

    def start(self, decoder, input_ids, input_lengths, capacity):
        # Pending tokens (at most 1 + num_draft_tokens) and the drafts fed after them fit beside the policy's.
        self.decoder = self.draft_engine.prefilled_decoder(input_ids, input_lengths, capacity + self.num_draft_tokens + 1)
        # Drafts must be policy token ids: the argmax is taken over the vocabulary both share.
        self.vocab_size = min(_vocab_size(decoder), _vocab_size(self.decoder))
        self.cached, self.uncommitted = input_lengths.clone(), 0

    def propose(self, history, lengths, limits):
        steps = int(limits.max()) if limits.numel() else 0
        rows, device = history.shape[0], history.device
        if steps == 0:
            self.uncommitted = 0
            return history.new_zeros(rows, 0), torch.zeros_like(limits)
        pending = lengths - self.cached  # >= 1 for running rows; 0 for finished rows kept in the batch
        width = max(int(pending.max()), 1)
        columns = self.cached.unsqueeze(1) + torch.arange(width, device=device)  # positions = context columns
        logits = self.decoder.extend(history.gather(1, columns.clamp(max=history.shape[1] - 1)), columns)
        self.decoder.rewind(width - pending)
        self.cached = lengths.clone()
        last = logits[torch.arange(rows, device=device), (pending - 1).clamp(min=0), : self.vocab_size]
        drafts = [last.argmax(-1)]
        for j in range(1, steps):
            logits = self.decoder.extend(drafts[-1].unsqueeze(1), (lengths + j - 1).unsqueeze(1))
            drafts.append(logits[:, 0, : self.vocab_size].argmax(-1))
        self.uncommitted = steps - 1
        return torch.stack(drafts, dim=1), limits.clamp(max=steps)

    def update(self, accepted):
        kept = accepted.clamp(max=self.uncommitted)
        if self.uncommitted:
            self.decoder.rewind(self.uncommitted - kept)
        self.cached = self.cached + kept
        self.uncommitted = 0

    def keep_rows(self, keep):
        self.decoder.keep_rows(keep)
        self.cached = self.cached[keep]

    def release(self):
        if self.decoder is not None:
            self.decoder.release()
        self.decoder, self.cached = None, None


class EarlyExitDrafter(Drafter):
    """Greedy drafts of the policy's first `num_layers` layers, its final norm and output head, on
    the policy's own KV cache (the llama-like decoder's `extend(num_layers=...)`)."""

    def __init__(self, num_draft_tokens: int, num_layers: int):
        super().__init__(num_draft_tokens)
        if num_layers < 1:
            raise ValueError(f"draft_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.decoder: Optional[LlamaLikeDecoder] = None

    def start(self, decoder, input_ids, input_lengths, capacity):
        if not isinstance(decoder, LlamaLikeDecoder):
            raise ValueError(
                "policy.generation.speculative.method=early_exit needs the llama-like decoder "
                "(decoders.unsupported_reason); this model decodes with its own forward"
            )
        if self.num_layers >= len(decoder.layers):
            raise ValueError(
                f"policy.generation.speculative.draft_layers={self.num_layers} must be below the model's "
                f"{len(decoder.layers)} layers"
            )
        self.decoder = decoder

    def propose(self, history, lengths, limits):
        steps = int(limits.max()) if limits.numel() else 0
        tokens, drafts = history.gather(1, (lengths - 1).unsqueeze(1)), []
        for j in range(steps):
            logits = self.decoder.extend(tokens, (lengths - 1 + j).unsqueeze(1), num_layers=self.num_layers)
            tokens = logits[:, 0].argmax(-1, keepdim=True)
            drafts.append(tokens[:, 0])
        if steps:
            self.decoder.rewind(torch.full_like(lengths, steps))  # the verification forward writes these columns again
            return torch.stack(drafts, dim=1), limits.clamp(max=steps)
        return history.new_zeros(history.shape[0], 0), torch.zeros_like(limits)

    def release(self):
        self.decoder = None


def _vocab_size(decoder: Any) -> int:
    model = decoder.model
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def make_drafter(
    method: str, *, num_draft_tokens: int = 4, ngram_size: int = 3, ngram_min_size: int = 1,
    draft_engine: Optional[Any] = None, draft_layers: Optional[int] = None,
) -> Optional[Drafter]:
    """The drafter of `policy.generation.speculative.method` ("none": None)."""
    if method == "none":
        return None
    if method == "ngram":
        return NgramDrafter(num_draft_tokens, ngram_size, ngram_min_size)
    if method == "draft_model":
        if draft_engine is None:
            raise ValueError("speculative method 'draft_model' needs a draft engine")
        return DraftModelDrafter(draft_engine, num_draft_tokens)
    if method == "early_exit":
        if draft_layers is None:
            raise ValueError("speculative method 'early_exit' needs draft_layers")
        return EarlyExitDrafter(num_draft_tokens, draft_layers)
    raise ValueError(f"unknown speculative method {method!r}: none, ngram, draft_model or early_exit")


def speculative_decode(
    drafter: Drafter, decoder: Any, logits: torch.Tensor, input_ids: torch.Tensor, input_lengths: torch.Tensor,
    run: Any, keep_fraction: float,
) -> dict[str, torch.Tensor]:
    """Decode after the prefill (`logits [B, V]`, the first token's) with drafts and verification,
    writing the outputs of `run` (the engine's `DecodeRun`) as plain decoding would; returns the
    per-row `SPECULATIVE_COUNTS`.

    `input_ids`, `input_lengths` are the right-padded prompts on the decoding device; the decoder
    holds their cache (capacity at least prompt width + `max_new_tokens` + `num_draft_tokens` + 1).
    """
    device = logits.device
    batch, width = input_ids.shape
    k = drafter.num_draft_tokens
    columns = torch.arange(k + 1, device=device)
    # Each decoder row's context from column 0: the prompt, then the tokens it emits.
    history = torch.full((batch, width + run.max_new_tokens + k + 1), run.pad_token_id, dtype=torch.long, device=device)
    history[:, :width] = input_ids
    lengths = input_lengths.clone()
    slot_rows = torch.arange(batch, device=device)  # decoder row -> original row
    generating = torch.ones(batch, dtype=torch.bool, device=device)
    counts_out = {name: torch.zeros(batch, dtype=torch.long, device=device) for name in SPECULATIVE_COUNTS}
    counts_out["speculative_forwards"] += 1  # the prefill
    drafter.start(decoder, input_ids, input_lengths, history.shape[1])

    # Round 0 checks the prefill's logits with no drafts: the first token, drawn as plain decoding draws it.
    step_logits, drafts, counts = logits.unsqueeze(1), history.new_zeros(batch, 0), torch.zeros_like(lengths)
    fed = 0  # tokens per row of the last `extend` (0: the prefill)
    while True:
        live = generating.nonzero().squeeze(1)
        rows = slot_rows[live]
        done = run.generation_lengths[rows]
        tokens, logprobs, emitted = _verify(step_logits, live, drafts[live], counts[live], run, rows, done)
        agreed = emitted - 1  # drafts kept before the policy's own token
        emitted, stopped = _cut_at_stops(run, rows, done, tokens, emitted)
        kept = torch.minimum(agreed, emitted)  # drafts among the emitted tokens

        valid = columns[: tokens.shape[1]] < emitted.unsqueeze(1)
        target_rows = rows.unsqueeze(1).expand_as(tokens)[valid]
        target_cols = (done.unsqueeze(1) + columns[: tokens.shape[1]])[valid]
        run.new_tokens[target_rows, target_cols] = tokens[valid]
        run.new_logprobs[target_rows, target_cols] = logprobs[valid]
        history[live.unsqueeze(1).expand_as(tokens)[valid], (lengths[live].unsqueeze(1) + columns[: tokens.shape[1]])[valid]] = tokens[valid]
        lengths[live] += emitted
        run.generation_lengths[rows] = done + emitted
        run.stopped[rows] = stopped
        counts_out["speculative_draft_tokens"][rows] += counts[live]
        counts_out["speculative_accepted_tokens"][rows] += kept
        if fed:  # take back the fed tokens after each row's last kept one (finished rows: all)
            taken_back = torch.full_like(lengths, fed)
            taken_back[live] = fed - emitted
            decoder.rewind(taken_back)
            accepted = torch.zeros_like(lengths)
            accepted[live] = kept
            drafter.update(accepted)

        finished = stopped | (done + emitted >= run.max_new_tokens)
        if finished.any():
            generating[live[finished]] = False
            num_finished = int((~generating).sum())
            if num_finished == slot_rows.numel():
                break
            if num_finished >= keep_fraction * slot_rows.numel():  # drop the finished rows
                keep = generating.nonzero().squeeze(1)
                decoder.keep_rows(keep)
                drafter.keep_rows(keep)
                slot_rows, history, lengths, generating = slot_rows[keep], history[keep], lengths[keep], generating[keep]

        # Drafts, at most up to each row's budget less the token the policy adds, then one forward over them.
        budget = run.max_new_tokens - run.generation_lengths[slot_rows] - 1
        limits = torch.where(generating, budget, 0).clamp(min=0, max=k)
        if bool(limits.any()):
            drafts, counts = drafter.propose(history, lengths, limits)
        else:
            drafts, counts = history.new_zeros(lengths.numel(), 0), torch.zeros_like(lengths)
        fed = 1 + int(counts.max())
        fed_tokens = torch.cat([history.gather(1, (lengths - 1).unsqueeze(1)), drafts[:, : fed - 1]], dim=1)
        fed_tokens[~generating] = run.pad_token_id
        step_logits = decoder.extend(fed_tokens, (lengths - 1).unsqueeze(1) + columns[:fed])
        counts_out["speculative_forwards"][slot_rows[generating]] += 1
    return counts_out


def _verify(
    logits: torch.Tensor, live: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor, run: Any,
    rows: torch.Tensor, done: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy's tokens at the fed positions of the running decoder rows `live` (of `logits
    [rows, m, V]`; original rows `rows`), each drawn from its row's stream at its step (`done + i`),
    position after position while the drafts agree.

    Returns `(tokens [r, m], logprobs [r, m], emitted [r])`: a row emits its first `emitted` tokens
    (the agreeing drafts, then the policy's own token).
    """
    num_rows, width = live.numel(), logits.shape[1]
    tokens = torch.full((num_rows, width), run.pad_token_id, dtype=torch.long, device=logits.device)
    logprobs = torch.zeros((num_rows, width), dtype=torch.float32, device=logits.device)
    emitted = torch.zeros(num_rows, dtype=torch.long, device=logits.device)
    going = torch.arange(num_rows, device=logits.device)
    for i in range(width):
        processed = process_logits(logits[live[going], i], temperature=run.temperature, top_k=run.top_k, top_p=run.top_p,
                                   buffers=run.buffers)
        token, token_logprob = sample(processed, run.seeds[rows[going]], run.start_steps[rows[going]] + done[going] + i,
                                      greedy=run.greedy, buffers=run.buffers)
        tokens[going, i], logprobs[going, i] = token, token_logprob
        emitted[going] = i + 1
        if i >= drafts.shape[1]:
            break
        agree = (counts[going] > i) & (drafts[going, i] == token)
        going = going[agree]
        if going.numel() == 0:
            break
    return tokens, logprobs, emitted


def _cut_at_stops(
    run: Any, rows: torch.Tensor, done: torch.Tensor, tokens: torch.Tensor, emitted: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(emitted, stopped)`: each row's emitted tokens cut after the first that ends it (eos, a stop
    token, or one completing a stop string), as plain decoding checks after every token."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    ends = torch.isin(tokens, run.end_ids) & (positions < emitted.unsqueeze(1))
    stopped = ends.any(dim=1)
    emitted = torch.where(stopped, ends.int().argmax(dim=1) + 1, emitted)
    if run.has_stop_strings:
        # Stop strings look at the output tokens: write the candidates first (beyond a row's cut they
        # are overwritten by its next tokens, and never read).
        valid = positions < emitted.unsqueeze(1)
        run.new_tokens[rows.unsqueeze(1).expand_as(tokens)[valid], (done.unsqueeze(1) + positions)[valid]] = tokens[valid]
        checking = [j for j, row in enumerate(rows.tolist()) if run.row_stop_strings[row]]
        emitted_list, done_list = emitted.tolist(), done.tolist()
        for i in range(tokens.shape[1]):
            checking = [j for j in checking if i < emitted_list[j]]
            if not checking:
                break
            hits = run.hits_stop_string(run.new_tokens, rows[checking], [done_list[j] + i + 1 for j in checking],
                                        run.row_stop_strings, run.earlier).tolist()
            for j, hit in zip(checking, hits):
                if hit:
                    emitted[j], stopped[j] = i + 1, True
            checking = [j for j, hit in zip(checking, hits) if not hit]
    return emitted, stopped
