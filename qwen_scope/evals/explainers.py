"""Chat backends for feature explanations: any local transformers chat model, or an OpenAI-compatible HTTP endpoint
(vLLM, SGLang, llama.cpp's server...). Both answer two requests, batched:

- ``complete(conversations, max_new_tokens)``: a greedy reply to each conversation (the explanation);
- ``yes_probability(conversations)``: ``P(yes) / (P(yes) + P(no))`` of the reply's first token (the judgement the
  detection score ranks).

    chat = TransformersChat("Qwen/Qwen3-0.6B")                         # a path or hub id
    chat = OpenAIChat("http://localhost:8000/v1", "Qwen/Qwen3-8B")     # a served model
"""
from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from pathlib import Path

import torch

__all__ = ["TransformersChat", "OpenAIChat"]

_YES, _NO = ("Yes", " Yes", "yes", " yes", "YES"), ("No", " No", "no", " no", "NO")


class TransformersChat:
    """A local transformers chat model as the explainer.

    Args:
        model: a hub id or directory, or a loaded causal LM.
        tokenizer: its tokenizer (default: loaded from ``model``); it must have a chat template.
        device, dtype: where and how a model given by name is loaded (default: CPU, the checkpoint's dtype).
        batch_size: conversations per forward.
    Raises:
        ValueError: the tokenizer has no chat template (a base model), or no single-token yes / no answer.

    Example:
        >>> chat = TransformersChat("Qwen/Qwen3-0.6B")
        >>> chat.complete([[{"role": "user", "content": "Say hi"}]], max_new_tokens=8)
    """

    def __init__(self, model, tokenizer=None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, batch_size: int = 8):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, (str, Path)):
            self.name = str(model)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.name)
            self._check_template(tokenizer)
            model = AutoModelForCausalLM.from_pretrained(self.name, dtype=dtype or "auto").to(device or "cpu")
        else:
            self.name = str(getattr(model, "name_or_path", "") or type(model).__name__)
            if tokenizer is None:
                raise ValueError(f"TransformersChat({self.name}): a loaded model needs its tokenizer= as well")
            self._check_template(tokenizer)
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.yes_ids, self.no_ids = _answer_ids(tokenizer, self.name)

    def _check_template(self, tokenizer) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"the explainer model {self.name} has no chat template: its tokenizer defines none, so "
                             f"it is a base model or lacks tokenizer_config.json's chat_template; pass a chat / "
                             f"instruct model (e.g. Qwen/Qwen3-0.6B) or set tokenizer.chat_template")

    def _encode(self, conversations: list[list[dict]]) -> dict:
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=False) for c in conversations]
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        try:
            batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            self.tokenizer.padding_side = side
        device = next(self.model.parameters()).device
        return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}

    def complete(self, conversations: list[list[dict]], max_new_tokens: int = 48) -> list[str]:
        """Greedy replies, one per conversation (``[{"role", "content"}, ...]``)."""
        out = []
        for a in range(0, len(conversations), self.batch_size):
            batch = self._encode(conversations[a:a + self.batch_size])
            with torch.no_grad():
                ids = self.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                          pad_token_id=self.tokenizer.pad_token_id)
            new = ids[:, batch["input_ids"].shape[1]:]
            out += [t.strip() for t in self.tokenizer.batch_decode(new, skip_special_tokens=True)]
        return out

    def yes_probability(self, conversations: list[list[dict]]) -> list[float]:
        """``P(yes) / (P(yes) + P(no))`` of each reply's first token (0.5 when both are 0)."""
        out = []
        for a in range(0, len(conversations), self.batch_size):
            batch = self._encode(conversations[a:a + self.batch_size])
            with torch.no_grad():
                probs = self.model(**batch).logits[:, -1].float().softmax(-1)
            yes, no = probs[:, self.yes_ids].sum(-1), probs[:, self.no_ids].sum(-1)
            out += torch.where(yes + no > 0, yes / (yes + no), torch.full_like(yes, 0.5)).tolist()
        return out


def _answer_ids(tokenizer, name: str) -> tuple[list[int], list[int]]:
    """First token ids of the yes / no spellings; an id both start with (a lone space byte) says nothing."""
    def first(words):
        return {ids[0] for w in words if (ids := tokenizer.encode(w, add_special_tokens=False))}

    yes, no = first(_YES), first(_NO)
    yes, no = sorted(yes - no), sorted(no - yes)
    if not yes or not no:
        raise ValueError(f"the explainer model {name}'s tokenizer has no first token that tells 'yes' from 'no'; "
                         f"use a model whose vocabulary has them")
    return yes, no


class OpenAIChat:
    """An OpenAI-compatible chat-completions endpoint as the explainer (stdlib HTTP, no client library).

    Args:
        base_url: e.g. ``"http://localhost:8000/v1"`` (``/chat/completions`` is appended).
        model: the served model's name.
        api_key: bearer token (default: ``$OPENAI_API_KEY``, none when unset).
        timeout: seconds per request.

    Judgements use the first reply token's ``top_logprobs`` when the server returns them, else the reply's text
    (yes = 1, no = 0, anything else 0.5).
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 120.0):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.name, self.timeout = model, f"{model} @ {base_url}", timeout
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")

    def _post(self, payload: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps({"model": self.model, **payload}).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:300]
            raise OSError(f"{self.url} answered HTTP {e.code}: {body}; check the model name ({self.model!r}) and "
                          f"the API key") from None
        except TimeoutError:
            raise OSError(f"{self.url} did not answer within {self.timeout:g} s; is the server busy or the model "
                          f"still loading? Raise timeout= or retry") from None
        except urllib.error.URLError as e:
            raise OSError(f"cannot reach {self.url} ({e.reason}); start the server (e.g. `vllm serve "
                          f"{self.model}`) or fix the base URL") from None

    def complete(self, conversations: list[list[dict]], max_new_tokens: int = 48) -> list[str]:
        return [self._post({"messages": c, "max_tokens": max_new_tokens, "temperature": 0})["choices"][0]["message"]
                ["content"].strip() for c in conversations]

    def yes_probability(self, conversations: list[list[dict]]) -> list[float]:
        out = []
        for c in conversations:
            choice = self._post({"messages": c, "max_tokens": 1, "temperature": 0, "logprobs": True,
                                 "top_logprobs": 10})["choices"][0]
            out.append(_judgement(choice))
        return out


def _judgement(choice: dict) -> float:
    content = ((choice.get("logprobs") or {}).get("content") or [{}])[0].get("top_logprobs") or []
    yes = sum(math.exp(t["logprob"]) for t in content if t["token"].strip().lower() == "yes")
    no = sum(math.exp(t["logprob"]) for t in content if t["token"].strip().lower() == "no")
    if yes + no > 0:
        return yes / (yes + no)
    text = (choice.get("message") or {}).get("content", "").strip().lower()
    return 1.0 if text.startswith("yes") else 0.0 if text.startswith("no") else 0.5
