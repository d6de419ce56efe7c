"""The speech LLM: Qwen2 backbone + speech-token embedding and head, upstream `Qwen2LM` (CosyVoice2) or
`CosyVoice3LM` (`LLMConfig.family`: 200 special rows, sos/task_id as speech rows, a head without bias).

`state_dict()` keys equal upstream's `llm.pt`, so `load_state_dict(torch.load(llm.pt), strict=True)` works.

Decoding rule (the engine runs the loop; `generate` is the same rule for one request in plain Python): prefill
`prefix(...)`, then per step sample a speech id from `log_probs` with RAS (`sampling.ras_sample`), masking
`cfg.min_len_masked_ids` while fewer than `min_len` tokens were emitted (upstream: only id 6561, CosyVoice2's eos
but CosyVoice3's sos); stop, without emitting, when the id is in `cfg.stop_token_ids` (so the other specials can
end decoding early) or after `max_len` tokens; otherwise emit the id and feed `speech_embedding[id]` at the next
position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from cosyvoice_opt.config import LLMConfig
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from cosyvoice_opt.models.sampling import ras_sample, sampling_uniforms

Sampler = Callable[[Tensor, list[int]], int]
"""`sample(logp, decoded) -> id`: one speech id from log-probs `[V]` (the min_len mask already applied) after the
ids `decoded` so far."""


class Qwen2Encoder(nn.Module):
    """Upstream's wrapper level (`llm.model...` in the checkpoint keys); holds nothing else."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(cfg.qwen2)


class SpeechLLM(nn.Module):
    SOS, TASK_ID = 0, 1  # rows of `llm_embedding` (CosyVoice2); CosyVoice3 maps them to `cfg.sos_task_rows`

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.qwen2.hidden_size
        if cfg.sos_task_rows is None:
            self.llm_embedding = nn.Embedding(2, hidden)
        self.llm = Qwen2Encoder(cfg)
        self.llm_decoder = nn.Linear(hidden, cfg.num_speech_rows, bias=cfg.head_bias)
        self.speech_embedding = nn.Embedding(cfg.num_speech_rows, hidden)

    @property
    def backbone(self) -> Qwen2Model:
        return self.llm.model.model

    def embed_text(self, ids: Tensor) -> Tensor:
        """Qwen text-token ids `[...]` -> `[..., H]`."""
        return self.backbone.embed_tokens(ids.long())

    def embed_speech(self, tokens: Tensor) -> Tensor:
        """Speech ids `[...]` (0 .. num_speech_rows-1) -> `[..., H]`."""
        return self.speech_embedding(tokens.long())

    def special_embedding(self, which: int) -> Tensor:
        """`SOS` or `TASK_ID` as `[1, 1, H]`."""
        rows = self.cfg.sos_task_rows
        table = self.llm_embedding if rows is None else self.speech_embedding
        return table.weight[which if rows is None else rows[which]].view(1, 1, -1)

    def prefix(self, text: Tensor, prompt_text: Tensor | None = None, prompt_speech: Tensor | None = None) -> Tensor:
        """`[sos, embed_tokens(prompt_text ++ text), task_id, speech_embedding(prompt_speech)]` as `[1, P, H]`.

        Ids are 1-D or `[1, T]`; `None` or empty parts are absent. CosyVoice3 requires `<|endofprompt|>` in the text.
        """
        parts = [self.special_embedding(self.SOS)]
        ids = text.reshape(-1) if prompt_text is None else torch.cat([prompt_text.reshape(-1), text.reshape(-1)])
        required = self.cfg.required_text_id
        if required is not None and not bool((ids == required).any()):
            raise ValueError(f"the {self.cfg.family} LLM needs the text id {required} (<|endofprompt|>) in "
                             "prompt_text ++ text; neither holds it")
        parts.append(self.embed_text(ids)[None])
        parts.append(self.special_embedding(self.TASK_ID))
        if prompt_speech is not None:
            parts.append(self.embed_speech(prompt_speech.reshape(-1))[None])
        return torch.cat(parts, dim=1)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Hidden `[..., H]` -> fp32 log-probs over the `num_speech_rows` speech ids (never the text head)."""
        return torch.log_softmax(self.llm_decoder(hidden).float(), dim=-1)

    def length_bounds(self, text_len: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for `text_len` target-text tokens (prompt text excluded)."""
        return int(text_len * self.cfg.min_token_text_ratio), int(text_len * self.cfg.max_token_text_ratio)

    @torch.inference_mode()
    def generate(self, text: Tensor, prompt_text: Tensor | None = None, prompt_speech: Tensor | None = None,
                 sample: Sampler | None = None, seed: int = 0) -> Iterator[int]:
        """Upstream `inference` for one request (the decoding rule of the module docstring), yielding speech ids.
        `sample` defaults to RAS with the engine's per-(seed, step) uniforms."""
        if sample is None:
            sample = self.ras_sampler(seed)
        min_len, max_len = self.length_bounds(text.numel())
        prefix = self.prefix(text, prompt_text, prompt_speech)
        p = prefix.shape[1]
        cache = KVCache(self.cfg.qwen2, 1, p + max_len, prefix.dtype, prefix.device)
        logp = self.prefill(prefix, cache, [0], [p])[0]
        masked, stops, decoded = self.cfg.min_len_masked_ids, frozenset(self.cfg.stop_token_ids), []
        for i in range(max_len):
            if i < min_len:
                logp = logp.clone()
                logp[masked.start : masked.stop] = float("-inf")
            tok = sample(logp, decoded)
            if tok in stops:
                return
            yield tok
            decoded.append(tok)
            logp = self.decode(torch.tensor([tok], device=prefix.device), cache, None,
                               torch.tensor([p + i], device=prefix.device))[0]

    def ras_sampler(self, seed: int) -> Sampler:
        """RAS (`sampling.ras_sample`) drawing step k's uniforms from (seed, k), as the engine does."""
        win = self.cfg.sampling.win_size

        def sample(logp: Tensor, decoded: list[int]) -> int:
            history = torch.tensor([[-1] * (win - len(decoded[-win:])) + decoded[-win:]], device=logp.device)
            u = sampling_uniforms(torch.tensor([seed]), torch.tensor([len(decoded)])).to(logp.device)
            no_mask = torch.zeros(1, dtype=torch.bool, device=logp.device)
            return int(ras_sample(logp[None], u, history, no_mask, self.cfg.eos_token, self.cfg.sampling))

        return sample

    def forward(self, embeds: Tensor) -> Tensor:
        """Teacher forcing: embeddings `[B, T, H]` -> log-probs `[B, T, V]` (causal, no cache)."""
        return self.log_probs(self.backbone(embeds))

    def prefill(self, embeds: Tensor, cache: KVCache, slots: Sequence[int], lengths: Sequence[int]) -> Tensor:
        """Prefixes packed along time `[1, sum(lengths), H]` into `slots` at positions `0..lengths[i]-1`
        -> log-probs `[len(slots), V]` of each request's last position (see `Qwen2Model.prefill`)."""
        return self.log_probs(self.backbone.prefill(embeds, cache, slots, lengths))

    def extend(self, embeds: Tensor, cache: KVCache, slot: int, start: int) -> tuple[Tensor, Tensor]:
        """Embeddings `[1, T, H]` fed at positions `start..` of `slot` after its cached ones -> (hidden `[H]`,
        log-probs `[V]`) of the last position (see `Qwen2Model.extend`)."""
        hidden = self.backbone.extend(embeds, cache, slot, start)[-1]
        return hidden, self.log_probs(hidden)

    def extend_rows(self, embeds: Sequence[Tensor], cache: KVCache, slots: Sequence[int],
                    starts: Sequence[int]) -> Tensor:
        """`extend` for several requests in one forward: embeddings `[1, T_i, H]` fed at positions `starts[i]..` of
        `slots[i]` -> log-probs `[n, V]` of each one's last position (see `Qwen2Model.extend_rows`). No host
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
        """Feed speech ids `tokens [B]` at `positions [B]` of `slots [B]` -> log-probs `[B, V]`.

        Static shapes, no host sync (CUDA-graph capturable); see `Qwen2Model.decode` for `slots`/`kv_len`.
        """
        return self.log_probs(self.backbone.decode(self.embed_speech(tokens)[:, None], cache, slots, positions, kv_len))
