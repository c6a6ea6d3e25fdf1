"""Native PyTorch generation engine for any Hugging Face causal LM.

`NativeGenerationEngine.generate` takes right-padded prompts (the project's convention), turns
them into left-padded ones with an attention mask and explicit position ids, runs one prefill
forward pass that fills a KV cache, then decodes one token per step, or, with a drafter
(`policy.generation.speculative`, `speculative.py`), checks several drafted tokens per forward and
emits the tokens plain decoding would. Rows that finish (eos, a stop token, a stop string, or
`max_new_tokens`) leave the running batch together with their KV cache rows, so they stop costing
compute.

The output follows the generation contract in `docs/internals.md` (and NeMo-RL's
`GenerationOutputSpec`): `output_ids [B, S+T]` (prompt + generated, right-padded),
`generation_lengths [B]`, `unpadded_sequence_lengths [B]`, `logprobs [B, S+T]` (processed
logprobs at generated positions, 0 elsewhere) and `truncated [B]`.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from transformers import DynamicCache

from posttrain.models import router_replay
from posttrain.models.generation.decoders import (
    LlamaLikeDecoder, ModelForwardDecoder, has_sliding_window, unsupported_reason,
)
from posttrain.models.generation.gemma3_decoder import fast_decoder
from posttrain.models.generation.running_batch import RunningBatch
from posttrain.models.generation.sampling import SamplingBuffers, process_logits, sample
from posttrain.models.generation.speculative import Drafter, speculative_decode
from posttrain.models.vision_inputs import image_inputs, image_token_id, suppress_image_token

logger = logging.getLogger(__name__)

StopStrings = Optional[Union[Sequence[str], Sequence[Optional[Sequence[str]]]]]

# A stop string of n characters is looked for in the decoded text of the last n + this many
# generated tokens: a token decodes to at least one character except for special tokens
# and partial UTF-8 bytes, for which this is the margin.
_STOP_STRING_TOKEN_MARGIN = 8


def right_to_left_padding(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_token_id: int, width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert right-padded prompts to left-padded ones of width `max(input_lengths)` (at least `width`).

    Returns `(left_ids [B, P], attention_mask [B, P], position_ids [B, P])`; positions count from
    0 at each row's first real token (padding positions hold 0 and are masked out).
    """
    width = max(width, int(input_lengths.max()))
    shift = (width - input_lengths).unsqueeze(1)  # left padding per row
    source_col = torch.arange(width, device=input_ids.device).unsqueeze(0) - shift
    attention_mask = (source_col >= 0).long()
    left_ids = input_ids.gather(1, source_col.clamp(min=0)).masked_fill(attention_mask == 0, pad_token_id)
    position_ids = source_col.clamp(min=0)
    return left_ids, attention_mask, position_ids


def per_row_stop_strings(stop_strings: StopStrings, batch_size: int) -> list[list[str]]:
    """Normalise `None | list[str] | list[list[str] | None]` (per row) to one list per row."""
    if not stop_strings:
        return [[] for _ in range(batch_size)]
    if all(isinstance(s, str) for s in stop_strings):
        stop_strings = [list(stop_strings)] * batch_size
    elif len(stop_strings) != batch_size:
        raise ValueError(
            f"per-sample stop_strings has {len(stop_strings)} entries but the batch has {batch_size} rows"
        )
    rows = []
    for i, row in enumerate(stop_strings):
        if row is None:
            rows.append([])
        elif isinstance(row, str) or not all(isinstance(s, str) for s in row):
            raise ValueError(f"stop_strings[{i}] must be a list of strings or None, got {row!r}")
        else:
            rows.append(list(row))
    for i, row in enumerate(rows):
        if any(s == "" for s in row):
            raise ValueError(f"stop_strings[{i}] contains an empty string")
    return rows


def assemble_outputs(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    new_tokens: torch.Tensor,
    new_logprobs: torch.Tensor,
    generation_lengths: torch.Tensor,
    stopped: torch.Tensor,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """The generation contract's outputs from per-row generated tokens (shared by every backend).

    Args:
        input_ids, input_lengths: the right-padded prompts `[B, S]` and their lengths `[B]`.
        new_tokens, new_logprobs: `[B, T']` generated tokens and their processed logprobs, valid
            up to `generation_lengths [B]` per row.
        stopped: `[B]` bool, the row ended on eos, a stop token or a stop string.

    Returns:
        `output_ids`, `generation_lengths`, `unpadded_sequence_lengths`, `logprobs` and
        `truncated` (`~stopped`), each row's tokens right after its prompt, right-padded.
    """
    batch_size, prompt_width = input_ids.shape
    out_device = input_ids.device
    new_tokens, new_logprobs = new_tokens.to(out_device), new_logprobs.to(out_device)
    generation_lengths, stopped = generation_lengths.to(out_device), stopped.to(out_device)
    longest = int(generation_lengths.max()) if batch_size else 0
    total_width = prompt_width + longest

    output_ids = torch.full((batch_size, total_width), pad_token_id, dtype=torch.long, device=out_device)
    prompt_cols = torch.arange(prompt_width, device=out_device).unsqueeze(0)
    output_ids[:, :prompt_width] = input_ids.masked_fill(prompt_cols >= input_lengths.unsqueeze(1), pad_token_id)
    logprobs = torch.zeros((batch_size, total_width), dtype=torch.float32, device=out_device)

    gen_cols = torch.arange(longest, device=out_device).unsqueeze(0)
    valid = gen_cols < generation_lengths.unsqueeze(1)
    target_cols = (input_lengths.unsqueeze(1) + gen_cols)[valid]
    target_rows = torch.arange(batch_size, device=out_device).unsqueeze(1).expand(-1, longest)[valid]
    output_ids[target_rows, target_cols] = new_tokens[:, :longest][valid]
    logprobs[target_rows, target_cols] = new_logprobs[:, :longest][valid]

    return {
        "output_ids": output_ids,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": input_lengths + generation_lengths,
        "logprobs": logprobs,
        "truncated": ~stopped,
    }


def distinct_prompts(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, image_keys: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group identical prompts (GRPO's generations of one prompt); with `image_keys [B]` (ids that are
    equal for rows with equal images, `image_groups`) the images must be identical too.

    Returns `(first_rows [U], row_map [B])`: one row holding each distinct prompt, and for every
    row the index of its prompt in `first_rows`.
    """
    batch_size, width = input_ids.shape
    beyond_prompt = torch.arange(width, device=input_ids.device).unsqueeze(0) >= input_lengths.unsqueeze(1)
    keys = torch.cat([input_lengths.unsqueeze(1), input_ids.masked_fill(beyond_prompt, -1)], dim=1)
    if image_keys is not None:
        keys = torch.cat([image_keys.to(keys.device).unsqueeze(1), keys], dim=1)
    _, row_map = torch.unique(keys, dim=0, return_inverse=True)
    rows = torch.arange(batch_size, device=input_ids.device)
    first_rows = torch.full((int(row_map.max()) + 1,), batch_size, dtype=torch.long, device=input_ids.device)
    first_rows.scatter_reduce_(0, row_map, rows, reduce="amin")
    return first_rows, row_map


def shared_prefix_length(input_ids: torch.Tensor, input_lengths: torch.Tensor) -> int:
    """The number of first tokens every right-padded prompt shares (a chat template's system prompt, a
    task's instructions), short of each prompt's last token, whose logits the prefill must compute."""
    longest = int(input_lengths.min()) - 1
    if input_ids.shape[0] < 2 or longest < 1:
        return 0
    agree = (input_ids[:, :longest] == input_ids[:1, :longest]).all(0)
    return int(agree.long().cumprod(0).sum())


def image_groups(pixel_values: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """`[B]` ids, equal for rows whose images are bit-identical (-1: a row without images)."""
    seen: dict[bytes, int] = {}
    keys = []
    for pixels in pixel_values:
        if pixels is None or not pixels.numel():
            keys.append(-1)
            continue
        data = pixels.detach().cpu().contiguous()
        key = bytes(str(tuple(data.shape)), "ascii") + data.view(torch.uint8).flatten().numpy().tobytes()
        keys.append(seen.setdefault(key, len(seen)))
    return torch.tensor(keys, dtype=torch.long)


@dataclass
class DecodeRun:
    """One `generate` call's sampling settings, per-row streams and stop conditions, and the output
    tensors decoding writes (indexed by original row), for the speculative decoding loop."""

    new_tokens: torch.Tensor  # [B, max_new_tokens]
    new_logprobs: torch.Tensor  # [B, max_new_tokens] float32
    generation_lengths: torch.Tensor  # [B]
    stopped: torch.Tensor  # [B] bool
    seeds: torch.Tensor
    start_steps: torch.Tensor
    end_ids: torch.Tensor  # eos and stop token ids
    max_new_tokens: int
    temperature: float
    top_k: Optional[int]
    top_p: float
    greedy: bool
    buffers: Optional[SamplingBuffers]
    pad_token_id: int
    row_stop_strings: list[list[str]]
    has_stop_strings: bool
    earlier: Optional[list[list[int]]]
    hits_stop_string: Callable[..., torch.Tensor]  # the engine's stop-string check


# The engine before the prefill/decode/sampling optimisations, for benchmarks and equivalence tests.
UNOPTIMISED = {"share_prompts": False, "llama_like_decoder": False, "reuse_buffers": False, "share_prompt_prefix": False}


class NativeGenerationEngine:
    """Batched KV-cache decoding with per-row seeds and processed logprobs.

    A shared prompt prefix is prefilled on its own when that saves `min_shared_prefix_tokens` token
    positions: the extra forward reads every weight once, which fewer tokens do not repay.

    Args:
        model: a Hugging Face causal LM (anything whose forward accepts `input_ids`,
            `attention_mask`, `position_ids`, `past_key_values`, `use_cache`).
        tokenizer: used only to decode the generated tail when stop strings are given (default
            None: stop strings are then an error).
        pad_token_id: written after each row's last token in `output_ids`.
        eos_token_id: an id or list of ids that end a row (kept in the output); None: none.
        share_prompts: prefill each distinct prompt once and copy its KV cache to the rows that
            share it (GRPO's generations of one prompt) (default True).
        llama_like_decoder: decode with `decoders.LlamaLikeDecoder` (preallocated KV cache; Gemma 3:
            `gemma3_decoder.Gemma3Decoder`) when the model is llama-like or Gemma 3 and passes its
            self-check; otherwise, or False, with the model's forward and a `DynamicCache` (default True).
        reuse_buffers: keep the sampling work tensors across steps (`sampling.SamplingBuffers`)
            (default True).
        finished_rows_fraction: a decoder that can keep finished rows in its batch (the llama-like
            one) drops them once they are at least this fraction of it, so the cache is copied a few
            times per generation instead of once per finishing step (default 0.25; 0: at once).
        share_prompt_prefix: prefill the first tokens all of a prefill's distinct prompts share (a system
            prompt, a task's instructions) once, for a single row, and copy their cache to every row
            (when that saves at least `min_shared_prefix_tokens` token positions; default True).
        speculative: a `speculative.Drafter` (`speculative.make_drafter`): speculative sampling,
            which emits the tokens plain decoding emits for the same seeds, and adds the per-row
            `speculative.SPECULATIVE_COUNTS` to the outputs (default None: plain decoding).
        batch_invariant: generate each row in a batch of its own, its prompt unpadded, so that a
            row's tokens and logprobs are a function of its prompt, seed and the weights alone: not
            of the rows beside it or of their lengths (`policy.batch_invariant`; default False).
            Batched matmuls and padded attention round differently for different batches; this
            gives that up, for about the cost of decoding rows one at a time.
        record_routing: a mixture of experts' chosen experts for every token fed to the model,
            returned as `router_replay.ROUTED_EXPERTS [B, S+T, layers, k]` (`models/router_replay.py`;
            default False).

    `UNOPTIMISED` turns the four prefill, decode and sampling optimisations off: the engine as it was before them.
    """

    min_shared_prefix_tokens = 64
    # Continuous batching's cache columns per row beyond prompt + max_new_tokens (None: max_new_tokens): a
    # full cache is compacted at most every margin + 1 steps, each time copying it.
    compaction_margin: Optional[int] = None

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        pad_token_id: int,
        eos_token_id: Optional[Union[int, Sequence[int]]],
        share_prompts: bool = True,
        llama_like_decoder: bool = True,
        reuse_buffers: bool = True,
        finished_rows_fraction: float = 0.25,
        share_prompt_prefix: bool = True,
        speculative: Optional[Drafter] = None,
        batch_invariant: bool = False,
        record_routing: bool = False,
    ):
        self.model = model
        # Router replay (models/router_replay.py): each fed token's chosen experts, in the outputs.
        self.record_routing = record_routing
        if record_routing and (speculative is not None or batch_invariant):
            raise ValueError("policy.moe_router_replay: the native engine records routing in plain batched decoding, "
                             "not with speculative decoding or policy.batch_invariant")
        self.batch_invariant = batch_invariant
        self.tokenizer = tokenizer
        self.pad_token_id = int(pad_token_id)
        if eos_token_id is None:
            self.eos_token_ids: list[int] = []
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = [eos_token_id]
        else:
            self.eos_token_ids = [int(t) for t in eos_token_id]
        if not 0 <= finished_rows_fraction <= 1:
            raise ValueError(f"finished_rows_fraction must be in [0, 1], got {finished_rows_fraction}")
        self.share_prompts = share_prompts
        self.reuse_buffers = reuse_buffers
        self.finished_rows_fraction = finished_rows_fraction
        # A shared prefix leaves the prompts' left padding between the prefix and the rest: masked columns
        # that a sliding window (counted in cache columns by transformers) would count as positions, so
        # a sliding-window model (Gemma 3's local layers) would attend to fewer tokens than in training.
        self.share_prompt_prefix = share_prompt_prefix and not has_sliding_window(model)
        self.speculative = speculative
        # Ask the model for the last position's logits only, when it supports it (saves a
        # [B, P, V] projection at prefill).
        self._supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # A vision-language model never generates its image token: one with no image behind it breaks
        # the next forward (the trainer's logprobs leave it out of the distribution the same way).
        self._image_token_id = image_token_id(model)
        self._llama_like: Optional[LlamaLikeDecoder] = None
        if llama_like_decoder and unsupported_reason(model) is None:
            self._llama_like = fast_decoder(model)  # Gemma 3: gemma3_decoder.Gemma3Decoder
        self._llama_like_checked = self._llama_like is None  # its self-check runs on first use
        self._recorder: Optional[router_replay.RoutingRecorder] = None  # set during a recording `generate`
        self._routing: Optional[torch.Tensor] = None

    def _decoder(self):
        """The llama-like decoder once it passed its self-check (run on first use), else the model's forward."""
        if not self._llama_like_checked:
            self._llama_like_checked = True
            problem = self._llama_like.self_check()
            if problem is not None:
                logger.warning("native generation: decoding with the model's forward instead: %s", problem)
                self._llama_like = None
        if self._llama_like is not None:
            return self._llama_like
        return ModelForwardDecoder(self.model, self._supports_logits_to_keep)

    def _prefill(self, input_ids, input_lengths, decoder, capacity: int,
                 pixel_values: Optional[Sequence[Optional[torch.Tensor]]] = None, *, width: int = 0,
                 rows: Optional[torch.Tensor] = None, admit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompts (with their images: `pixel_values`, one entry per row, a vision-language
        model's; `models/vision_inputs.py`) through the model and hand their KV cache to `decoder`, left
        padded to at least `width` positions. Decoding then feeds text tokens only: the images are in the cache.

        `rows`: the prompts' rows in the `generate` call (default: all, in order), where recorded routing
        goes. With `admit`, the prompts join the rows the decoder runs (continuous batching); without,
        they start its batch.

        Returns the next-token logits `[B, V]` and the position ids `[B]` of the first generated token.
        """
        batch_size = input_ids.shape[0]
        if self.share_prompts:
            first_rows, row_map = distinct_prompts(
                input_ids, input_lengths, image_groups(pixel_values) if pixel_values is not None else None)
        else:
            first_rows = row_map = torch.arange(batch_size, device=input_ids.device)
        prompts, prompt_lengths = input_ids[first_rows], input_lengths[first_rows]
        cache = DynamicCache()
        extra = {"logits_to_keep": 1} if self._supports_logits_to_keep else {}
        shared = 0
        if self.share_prompt_prefix and pixel_values is None and self._routing is None:
            shared = shared_prefix_length(prompts, prompt_lengths)
            if shared * (prompts.shape[0] - 1) < self.min_shared_prefix_tokens:
                shared = 0
        if shared:  # the prefix once, its cache copied to every prompt, then the rest of each prompt after it
            self.model(input_ids=prompts[:1, :shared], position_ids=torch.arange(shared, device=prompts.device)[None],
                       past_key_values=cache, use_cache=True, **extra)
            cache.batch_repeat_interleave(prompts.shape[0])
        ids, attention_mask, position_ids = right_to_left_padding(
            prompts[:, shared:], prompt_lengths - shared, self.pad_token_id, max(width - shared, 0))
        if pixel_values is not None:
            dtype = next(self.model.parameters()).dtype
            extra.update(image_inputs([pixel_values[row] for row in first_rows.tolist()], ids.device, dtype))
        if shared:  # [prefix][left padding][rest]: the padding sits in the middle, masked
            attention_mask = torch.cat([attention_mask.new_ones(ids.shape[0], shared), attention_mask], dim=1)
            position_ids = position_ids + shared
        out = self.model(
            input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True, **extra,
        )
        if admit:
            decoder.admit(cache, attention_mask, row_map)
        else:
            decoder.start(cache, attention_mask, row_map, capacity)
        if self._routing is not None:
            router_replay.file_prefill(self._routing, self._recorder.take(), input_lengths[first_rows], row_map, rows)
        return out.logits[:, -1, :].index_select(0, row_map), (position_ids[:, -1] + 1).index_select(0, row_map)

    def prefilled_decoder(self, input_ids: torch.Tensor, input_lengths: torch.Tensor, capacity: int):
        """A decoder holding the KV cache of the right-padded prompts (`capacity` positions per row), for
        feeding tokens with `extend` (a draft model's engine, `speculative.DraftModelDrafter`)."""
        decoder = self._decoder()
        self._prefill(input_ids, input_lengths, decoder, capacity)
        return decoder

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        input_lengths: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: Optional[int] = None,
        greedy: bool = False,
        stop_token_ids: Optional[Sequence[int]] = None,
        stop_strings: StopStrings = None,
        seeds: Optional[torch.Tensor] = None,
        start_steps: Optional[torch.Tensor] = None,
        pixel_values: Optional[Sequence[Optional[torch.Tensor]]] = None,
        max_running_rows: Optional[int] = None,
    ) -> dict[str, torch.Tensor]:
        """Generate up to `max_new_tokens` tokens for each right-padded prompt.

        Args:
            input_ids: `[B, S]` right-padded prompt token ids.
            input_lengths: `[B]` valid prompt tokens per row (each >= 1).
            max_new_tokens: generation budget per row.
            temperature, top_p, top_k: see `sampling.process_logits` (defaults 1.0, 1.0, None).
                Reported logprobs are always those of the processed distribution, also when
                `greedy`.
            greedy: argmax decoding (default False).
            stop_token_ids: extra ids that end a row like eos (default None).
            stop_strings: strings that end a row once the decoded generated text contains one;
                one list for all rows or one list (or None) per row (default None). The row ends
                with the token that completes the stop string (tokens are never split), and the
                row is not marked truncated.
            seeds: `[B]` int64 per-row seeds (default None: drawn from torch's global RNG). The
                same seed gives the same tokens whatever else is in the batch.
            start_steps: `[B]` int64, tokens of the row's current turn already generated, at the end of
                its prompt (default None: all 0). The row continues that generation: its random
                stream starts at decoding step `start_steps` and its stop strings are looked for
                across those tokens too, so generating a turn in chunks (partial rollouts) draws
                the tokens one uninterrupted generation would under the same weights and seed.
            pixel_values: a vision-language model's images, one entry per row (`[n_images, 3, H, W]`
                or None; default None), whose image tokens the prompts hold (`models/vision_inputs.py`).
            max_running_rows: rows decoded at once (default None: all). With more rows than this, the
                llama-like decoder batches continuously (`running_batch.py`: finished rows leave its batch
                and waiting ones are prefilled into their places); other decoders, and speculative
                decoding, generate the rows in consecutive pieces of this many.

        Returns:
            dict with `output_ids [B, S+T]` (T = longest generation), `generation_lengths [B]`,
            `unpadded_sequence_lengths [B]`, `logprobs [B, S+T]` float32 and `truncated [B]`
            bool, all on the input device.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        batch_size, prompt_width = input_ids.shape
        input_lengths = input_lengths.to(input_ids.device).long()
        if input_lengths.shape != (batch_size,):
            raise ValueError(f"input_lengths must be [{batch_size}], got shape {tuple(input_lengths.shape)}")
        if batch_size and (input_lengths.min() < 1 or input_lengths.max() > prompt_width):
            raise ValueError(
                f"input_lengths must be in [1, {prompt_width}] (the padded width), got {input_lengths.tolist()}"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        row_stop_strings = per_row_stop_strings(stop_strings, batch_size)
        has_stop_strings = any(row_stop_strings)
        if has_stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass one to NativeGenerationEngine")
        if pixel_values is not None and len(pixel_values) != batch_size:
            raise ValueError(f"pixel_values has {len(pixel_values)} entries but the batch has {batch_size} rows")
        if self._image_token_id is not None and pixel_values is None and bool((input_ids == self._image_token_id).any()):
            raise ValueError("the prompts hold image tokens but no pixel_values came with them (a batch builder "
                             "dropped the images: flatten_message_logs / message_log_images carries them)")
        if pixel_values is not None and self.speculative is not None:
            raise ValueError("speculative decoding with images is not supported (the drafter does not see them)")

        if batch_size == 0:  # e.g. an empty data-parallel shard
            return self._assemble_outputs(
                input_ids, input_lengths, input_ids.new_zeros(0, 0), torch.zeros(0, 0),
                input_lengths.new_zeros(0), torch.zeros(0, dtype=torch.bool),
            )

        device = next(self.model.parameters()).device
        if seeds is None:
            seeds = torch.randint(0, 2**62, (batch_size,), dtype=torch.long)
        seeds = seeds.long().to(device)
        if start_steps is None:
            start_steps = torch.zeros(batch_size, dtype=torch.long)
        start_steps = start_steps.long().to(device)
        if start_steps.shape != (batch_size,) or bool((start_steps < 0).any()) or bool((start_steps >= input_lengths.to(device)).any()):
            raise ValueError(f"start_steps must be [{batch_size}] in [0, input_lengths), got {start_steps.tolist()}")
        if max_running_rows is not None and max_running_rows < 1:
            raise ValueError(f"max_running_rows must be >= 1, got {max_running_rows}")
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                        greedy=greedy, stop_token_ids=stop_token_ids)
        if self.batch_invariant and (batch_size > 1 or int(input_lengths[0]) < prompt_width):
            return self._generate_in_pieces(input_ids, input_lengths, seeds, start_steps, row_stop_strings, sampling,
                                            pixel_values, piece_rows=1)
        decoder = self._decoder()
        continuous = max_running_rows is not None and batch_size > max_running_rows
        if continuous and (self.speculative is not None or not isinstance(decoder, LlamaLikeDecoder)):
            return self._generate_in_pieces(input_ids, input_lengths, seeds, start_steps, row_stop_strings, sampling,
                                            pixel_values, piece_rows=max_running_rows)
        # Each row's tokens of the turn generated before this call: stop strings may span them.
        earlier = [input_ids[row, int(input_lengths[row]) - n : int(input_lengths[row])].tolist() if n else []
                   for row, n in enumerate(start_steps.tolist())] if has_stop_strings else None
        end_ids = torch.tensor(self.eos_token_ids + list(stop_token_ids or []), dtype=torch.long, device=device)

        # Outputs of the whole batch, indexed by original row.
        new_tokens = torch.full((batch_size, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        new_logprobs = torch.zeros((batch_size, max_new_tokens), dtype=torch.float32, device=device)
        generation_lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        stopped = torch.zeros(batch_size, dtype=torch.bool, device=device)

        run = DecodeRun(
            new_tokens, new_logprobs, generation_lengths, stopped, seeds, start_steps, end_ids, max_new_tokens,
            temperature, top_k, top_p, greedy, None, self.pad_token_id, row_stop_strings, has_stop_strings,
            earlier, self._hits_stop_string,
        )
        drafts = self.speculative.num_draft_tokens + 1 if self.speculative is not None else 0
        self._recorder = router_replay.RoutingRecorder(self.model).__enter__() if self.record_routing else None
        self._routing = None if self._recorder is None else router_replay.empty_routing(
            self._recorder, batch_size, prompt_width + max_new_tokens, device)
        ids, lengths = input_ids.to(device), input_lengths.to(device)
        # Continuous batching: every prompt fits before the first fed column. A running row spans at most
        # width + max_new_tokens - 1 columns, so once the cache is full its first `margin` + 1 columns are
        # masked in every running row, and `_decode` moves the rows left past them (compaction).
        width = int(lengths.max()) if continuous else 0
        margin = (max_new_tokens if self.compaction_margin is None else self.compaction_margin) if continuous else drafts
        capacity = (width if continuous else prompt_width) + max_new_tokens + margin
        try:
            if self.speculative is not None:
                logits, _ = self._prefill(ids, lengths, decoder, capacity, pixel_values)
                run.buffers = SamplingBuffers(batch_size, logits.shape[-1], device) if self.reuse_buffers else None
                keep_fraction = self.finished_rows_fraction if decoder.keeps_finished_rows else 0.0
                try:
                    counts = speculative_decode(self.speculative, decoder, logits, ids, lengths, run, keep_fraction)
                finally:
                    self.speculative.release()
                outputs = self._assemble_outputs(input_ids, input_lengths, new_tokens, new_logprobs,
                                                 generation_lengths, stopped)
                return {**outputs, **{name: count.to(input_ids.device) for name, count in counts.items()}}
            # Continuous batching admits the longest prompts first (`running_batch.py`).
            order = torch.argsort(lengths, descending=True, stable=True) if continuous else torch.arange(batch_size, device=device)
            running = RunningBatch.empty(order, max_running_rows if continuous else batch_size)
            logits = self._admit(running, decoder, ids, lengths, pixel_values, capacity, width, start=True)
            run.buffers = SamplingBuffers(running.size, logits.shape[-1], device) if self.reuse_buffers else None
            self._decode(decoder, running, logits, run, ids, lengths, pixel_values, capacity, continuous)
        finally:
            decoder.release()  # the cache is this call's: not held into the phases after it
            if self._recorder is not None:
                self._recorder.__exit__()
        outputs = self._assemble_outputs(input_ids, input_lengths, new_tokens, new_logprobs, generation_lengths, stopped)
        if self._routing is not None:
            width = outputs["output_ids"].shape[1]
            outputs[router_replay.ROUTED_EXPERTS] = self._routing[:, :width].to(input_ids.device)
        self._routing = self._recorder = None
        return outputs

    def _admit(self, running: RunningBatch, decoder, input_ids: torch.Tensor, input_lengths: torch.Tensor,
               pixel_values: Optional[Sequence], capacity: int, width: int = 0, start: bool = False) -> torch.Tensor:
        """Prefill the waiting rows that fit into the decoder's batch (with `start`, the first ones, which
        start it); their next-token logits."""
        rows = running.take_waiting()
        logits, positions = self._prefill(
            input_ids[rows], input_lengths[rows], decoder, capacity,
            None if pixel_values is None else [pixel_values[row] for row in rows.tolist()],
            width=width, rows=rows, admit=not start,
        )
        running.add(rows, positions)
        return logits

    def _decode(self, decoder, running: RunningBatch, logits: torch.Tensor, run: DecodeRun, input_ids: torch.Tensor,
                input_lengths: torch.Tensor, pixel_values: Optional[Sequence], capacity: int, continuous: bool) -> None:
        """Plain decoding: sample a token for every running row from `logits`, feed it, repeat until every
        row of the call finished; rows waiting for a place in the decoder's batch (`continuous`) are
        prefilled into it as others leave. Writes `run`'s outputs."""
        keep_fraction = self.finished_rows_fraction if decoder.keeps_finished_rows else 0.0
        while True:
            live = running.live()  # None: every slot
            rows = running.slot_rows if live is None else running.slot_rows[live]
            steps = running.steps if live is None else running.steps[live]
            step_logits = logits if live is None else logits[live]
            if self._image_token_id is not None:
                step_logits = suppress_image_token(step_logits, self._image_token_id)
            processed = process_logits(step_logits, temperature=run.temperature, top_k=run.top_k, top_p=run.top_p,
                                       buffers=run.buffers)
            tokens, token_logprobs = sample(processed, run.seeds[rows], run.start_steps[rows] + steps, greedy=run.greedy,
                                            buffers=run.buffers)
            run.new_tokens[rows, steps] = tokens
            run.new_logprobs[rows, steps] = token_logprobs
            run.generation_lengths[rows] = steps + 1
            finished = torch.isin(tokens, run.end_ids)
            if run.has_stop_strings and any(run.row_stop_strings[i] for i in rows.tolist()):
                finished |= self._hits_stop_string(run.new_tokens, rows, (steps + 1).tolist(), run.row_stop_strings,
                                                   run.earlier)
            run.stopped[rows] = finished
            finished |= steps + 1 >= run.max_new_tokens  # the budget: truncated, not stopped
            tokens = running.advance(live, tokens, finished, self.pad_token_id)
            if running.done:
                break
            full = continuous and decoder.length >= capacity  # compaction makes room (`generate`'s capacity)
            if full or (running.num_finished and running.num_finished >= keep_fraction * running.size):
                keep = running.generating.nonzero().squeeze(1)
                if continuous:  # columns every kept row masks, short of what the longest waiting prompt needs
                    room = decoder.length - (int(input_lengths[running.waiting].max()) if running.waiting.numel() else 0)
                    masked = int(decoder.first_column[keep].min()) if keep.numel() else room
                    decoder.keep_rows(keep, shift=max(0, min(masked, room)))
                else:
                    decoder.keep_rows(keep)
                running.keep(keep)
                tokens = tokens[keep]
            if running.size:
                logits = decoder.step(tokens, running.positions)
                running.positions += 1
                if self._routing is not None:  # each fed token sits at column input_length + (its step - 1)
                    fed = running.generating
                    fed_rows = running.slot_rows[fed]
                    self._routing[fed_rows, input_lengths[fed_rows] + running.steps[fed] - 1] = \
                        self._recorder.take()[fed].to(self._routing.dtype)
            if running.waiting.numel() and running.size < running.max_running_rows:
                admitted = self._admit(running, decoder, input_ids, input_lengths, pixel_values, capacity)
                logits = torch.cat([logits, admitted]) if running.size > admitted.shape[0] else admitted

    def _generate_in_pieces(
        self, input_ids: torch.Tensor, input_lengths: torch.Tensor, seeds: torch.Tensor, start_steps: torch.Tensor,
        row_stop_strings: list[list[str]], sampling: dict, pixel_values: Optional[Sequence], piece_rows: int,
    ) -> dict[str, torch.Tensor]:
        """`generate` over consecutive pieces of `piece_rows` rows, each piece's prompts cut to its longest
        (1: batch-invariant mode, every row alone and unpadded); the outputs put together as one batched
        call returns them (speculative counts row by row, recorded routing at each row's columns)."""
        pieces = []
        for start in range(0, input_ids.shape[0], piece_rows):
            rows = slice(start, start + piece_rows)
            width = int(input_lengths[rows].max())
            pieces.append(self.generate(
                input_ids[rows, :width], input_lengths[rows], seeds=seeds[rows], start_steps=start_steps[rows],
                stop_strings=[stops or None for stops in row_stop_strings[rows]],
                pixel_values=None if pixel_values is None else pixel_values[rows], **sampling,
            ))
        lengths = torch.cat([piece["generation_lengths"] for piece in pieces])
        width = max(int(lengths.max()), 1)
        new_tokens = torch.full((len(lengths), width), self.pad_token_id, dtype=torch.long)
        new_logprobs = torch.zeros(len(lengths), width)
        row = 0
        for piece in pieces:
            for k in range(piece["generation_lengths"].numel()):
                start, count = int(input_lengths[row]), int(lengths[row])
                new_tokens[row, :count] = piece["output_ids"][k, start : start + count]
                new_logprobs[row, :count] = piece["logprobs"][k, start : start + count]
                row += 1
        stopped = ~torch.cat([piece["truncated"] for piece in pieces])
        outputs = self._assemble_outputs(input_ids, input_lengths, new_tokens, new_logprobs, lengths, stopped)
        if router_replay.ROUTED_EXPERTS in pieces[0]:  # right-padded per piece: a row's columns are the same
            parts = [piece[router_replay.ROUTED_EXPERTS] for piece in pieces]
            total = outputs["output_ids"].shape[1]
            routing = parts[0].new_full((len(lengths), total, *parts[0].shape[2:]), router_replay.NOT_RECORDED)
            row = 0
            for part in parts:
                columns = min(total, part.shape[1])
                routing[row : row + part.shape[0], :columns] = part[:, :columns]
                row += part.shape[0]
            outputs[router_replay.ROUTED_EXPERTS] = routing
        extra = set(pieces[0]) - set(outputs)  # speculative sampling's per-row counts
        return {**outputs, **{name: torch.cat([piece[name] for piece in pieces]) for name in sorted(extra)}}

    def _hits_stop_string(
        self, new_tokens: torch.Tensor, active: torch.Tensor, num_generated: Union[int, Sequence[int]],
        row_stop_strings: list[list[str]], earlier: Optional[list[list[int]]] = None,
    ) -> torch.Tensor:
        """`[len(active)]` bool: the decoded generated tail of the row contains a stop string.

        Only the last few of the row's first `num_generated` tokens (one count for all rows, or one
        per row) are decoded, `earlier[row]` (the turn's tokens generated before this call) in front
        of them. A stop string found here ends in the newest token, because the check runs after
        every token and an earlier match would have ended the row.
        """
        rows = active.tolist()
        generated = [num_generated] * len(rows) if isinstance(num_generated, int) else list(num_generated)
        checked = [j for j, row in enumerate(rows) if row_stop_strings[row]]
        windows = []
        for j in checked:
            longest = max(len(s) for s in row_stop_strings[rows[j]])
            width = longest + _STOP_STRING_TOKEN_MARGIN
            start = max(0, generated[j] - width)
            window = new_tokens[rows[j], start : generated[j]].tolist()
            if earlier is not None and len(window) < width:
                window = earlier[rows[j]][max(0, len(earlier[rows[j]]) - (width - len(window))):] + window
            windows.append(window)
        texts = self.tokenizer.batch_decode(windows, skip_special_tokens=False)
        hits = torch.zeros(len(rows), dtype=torch.bool)
        for j, text in zip(checked, texts):
            hits[j] = any(s in text for s in row_stop_strings[rows[j]])
        return hits.to(active.device)

    def _assemble_outputs(self, input_ids, input_lengths, new_tokens, new_logprobs, generation_lengths, stopped):
        return assemble_outputs(
            input_ids, input_lengths, new_tokens, new_logprobs, generation_lengths, stopped, self.pad_token_id
        )
