"""The CosyVoice2 speech LLM (upstream `Qwen2LM`): Qwen2 backbone + speech-token embedding and head.

`state_dict()` keys equal upstream's `llm.pt`, so `load_state_dict(torch.load(llm.pt), strict=True)` works.

Decoding rule (the engine runs the loop): prefill `prefix(...)`, then per step sample a speech id from
`log_probs` with RAS (`sampling.ras_sample`), masking only `cfg.eos_token` (6561) while fewer than `min_len`
tokens were emitted (`ignore_eos`); stop, without emitting, when the id is in `cfg.stop_token_ids`
(6561, 6562, 6563: the two non-EOS ids can still end decoding early) or after `max_len` tokens; otherwise
emit the id and feed `speech_embedding[id]` at the next position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cosyvoice_opt.config import LLMConfig
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.qwen2 import Qwen2ForCausalLM, Qwen2Model


class Qwen2Encoder(nn.Module):
    """Upstream's wrapper level (`llm.model...` in the checkpoint keys); holds nothing else."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(cfg.qwen2)


class SpeechLLM(nn.Module):
    SOS, TASK_ID = 0, 1  # rows of `llm_embedding`

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.qwen2.hidden_size
        self.llm_embedding = nn.Embedding(2, hidden)
        self.llm = Qwen2Encoder(cfg)
        self.llm_decoder = nn.Linear(hidden, cfg.num_speech_rows)
        self.speech_embedding = nn.Embedding(cfg.num_speech_rows, hidden)

    @property
    def backbone(self) -> Qwen2Model:
        return self.llm.model.model

    def embed_text(self, ids: Tensor) -> Tensor:
        """Qwen text-token ids `[...]` -> `[..., H]`."""
        return self.backbone.embed_tokens(ids.long())

    def embed_speech(self, tokens: Tensor) -> Tensor:
        """Speech ids `[...]` (0..6563) -> `[..., H]`."""
        return self.speech_embedding(tokens.long())

    def special_embedding(self, row: int) -> Tensor:
        """`SOS` or `TASK_ID` as `[1, 1, H]`."""
        return self.llm_embedding.weight[row].view(1, 1, -1)

    def prefix(self, text: Tensor, prompt_text: Tensor | None = None, prompt_speech: Tensor | None = None) -> Tensor:
        """`[sos, embed_tokens(prompt_text ++ text), task_id, speech_embedding(prompt_speech)]` as `[1, P, H]`.

        Ids are 1-D or `[1, T]`; `None` or empty parts are absent.
        """
        parts = [self.special_embedding(self.SOS)]
        ids = text.reshape(-1) if prompt_text is None else torch.cat([prompt_text.reshape(-1), text.reshape(-1)])
        parts.append(self.embed_text(ids)[None])
        parts.append(self.special_embedding(self.TASK_ID))
        if prompt_speech is not None:
            parts.append(self.embed_speech(prompt_speech.reshape(-1))[None])
        return torch.cat(parts, dim=1)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Hidden `[..., H]` -> fp32 log-probs over the 6564 speech ids (never the text head)."""
        return torch.log_softmax(self.llm_decoder(hidden).float(), dim=-1)

    def length_bounds(self, text_len: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for `text_len` target-text tokens (prompt text excluded)."""
        return int(text_len * self.cfg.min_token_text_ratio), int(text_len * self.cfg.max_token_text_ratio)

    def forward(self, embeds: Tensor) -> Tensor:
        """Teacher forcing: embeddings `[B, T, H]` -> log-probs `[B, T, 6564]` (causal, no cache)."""
        return self.log_probs(self.backbone(embeds))

    def prefill(self, embeds: Tensor, cache: KVCache, slots: Sequence[int], lengths: Sequence[int]) -> Tensor:
        """Prefixes packed along time `[1, sum(lengths), H]` into `slots` at positions `0..lengths[i]-1`
        -> log-probs `[len(slots), 6564]` of each request's last position (see `Qwen2Model.prefill`)."""
        return self.log_probs(self.backbone.prefill(embeds, cache, slots, lengths))

    def extend(self, embeds: Tensor, cache: KVCache, slot: int, start: int) -> tuple[Tensor, Tensor]:
        """Embeddings `[1, T, H]` fed at positions `start..` of `slot` after its cached ones -> (hidden `[H]`,
        log-probs `[6564]`) of the last position (see `Qwen2Model.extend`)."""
        hidden = self.backbone.extend(embeds, cache, slot, start)[-1]
        return hidden, self.log_probs(hidden)

    def extend_rows(self, embeds: Sequence[Tensor], cache: KVCache, slots: Sequence[int],
                    starts: Sequence[int]) -> Tensor:
        """`extend` for several requests in one forward: embeddings `[1, T_i, H]` fed at positions `starts[i]..` of
        `slots[i]` -> log-probs `[n, 6564]` of each one's last position (see `Qwen2Model.extend_rows`). No host
        sync."""
        t = max(e.shape[1] for e in embeds)
        x, index = self.padded_rows(embeds, slots, starts, t, len(embeds))
        index = index.to(x.device, non_blocking=True)
        positions, slot_ids = index[: x.shape[0] * t].view(-1, t), index[x.shape[0] * t :]
        kv_len = max(s + e.shape[1] for s, e in zip(starts, embeds, strict=True))
        return self.log_probs(self.backbone.extend_rows(x, cache, slot_ids, positions, kv_len)[:, -1])

    @staticmethod
    def padded_rows(embeds: Sequence[Tensor], slots: Sequence[int], starts: Sequence[int], t: int,
                    rows: int) -> tuple[Tensor, Tensor]:
        """Embeddings `[1, T_i, H]` (T_i <= t) fed after `starts[i]` positions of `slots[i]`, as
        `Qwen2Model.extend_rows` takes them: x `[rows, t, H]`, each row padded by repeating its last input, and
        after the n rows copies of the first (the same keys and values written again); and one host index tensor:
        the positions `[rows, t]` (a row's last one repeated), then the slots `[rows]`. Every row's last column is
        its last input."""
        pad = rows - len(embeds)
        x = torch.cat([torch.cat((e, e[:, -1:].expand(1, t - e.shape[1], -1)), dim=1) for e in embeds])
        last = torch.tensor([e.shape[1] - 1 for e in embeds])
        pos = torch.tensor(list(starts))[:, None] + torch.minimum(torch.arange(t), last[:, None])
        x, pos = torch.cat((x, x[:1].expand(pad, -1, -1))), torch.cat((pos, pos[:1].expand(pad, -1)))
        return x, torch.cat((pos.reshape(-1), torch.tensor([*slots, *slots[:1] * pad])))

    def decode(
        self, tokens: Tensor, cache: KVCache, slots: Tensor | None, positions: Tensor, kv_len: int | None = None
    ) -> Tensor:
        """Feed speech ids `tokens [B]` at `positions [B]` of `slots [B]` -> log-probs `[B, 6564]`.

        Static shapes, no host sync (CUDA-graph capturable); see `Qwen2Model.decode` for `slots`/`kv_len`.
        """
        return self.log_probs(self.backbone.decode(self.embed_speech(tokens)[:, None], cache, slots, positions, kv_len))
