"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from minengine.config import EngineConfig
from minengine.engine import Engine
from minengine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated
    text: str
    finish_reason: str


class LLM:
    def __init__(self, model: str = "tiny", **config):
        self.config = EngineConfig.from_kwargs(model=model, **config)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order. Every request is checked before any runs."""
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new one")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"{len(params)} sampling_params for {len(ids)} prompts; give one, or one per prompt")
        for i, (p_ids, p) in enumerate(zip(ids, params, strict=True)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is a {type(p).__name__}; expected SamplingParams")
            try:
                self.engine.check_request(p_ids, p)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None

        reqs = [self.engine.add_request(p_ids, p) for p_ids, p in zip(ids, params, strict=True)]
        with tqdm(total=len(reqs), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(sum(r.finished for r in self.engine.step()))
        return [
            RequestOutput(r.rid, text, r.prompt_ids, r.output_ids, r.text, r.finish_reason)
            for r, text in zip(reqs, texts, strict=True)
        ]

    def shutdown(self) -> None:
        """Free the model and the KV cache (GPU memory included). Safe to call twice."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
