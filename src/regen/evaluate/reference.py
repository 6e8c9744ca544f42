"""Reference of DFlash speculative decoding: block drafting and greedy verification in PyTorch.

It runs on the CPU (the embedded default's evaluate stage) or on a GPU (`regen.jobs.evaluate --device cuda`,
the GPU smoke script); one sequence at a time either way, so it measures the decoding algorithm, not a
serving engine.

The target runs through `transformers` with a KV cache, the drafter is SpecForge's own `DFlashDraftModel`
loaded from the exported checkpoint, and one step follows SpecForge 0.2.0's
`DFlashDraftModel.spec_generate` (and its `scripts/bench_dflash_acceptance.py`):

1. the block is ``[last committed token, mask, mask, ...]`` (``block_size`` tokens, the mask token from the
   drafter's ``dflash_config``), embedded with the *target's* input embeddings;
2. the drafter attends to the target's hidden states of every committed position before the block
   (layers ``dflash_config.target_layer_ids``, ``hidden_states[layer + 1]``, concatenated) through its own
   KV cache, and to the block bidirectionally; the *target's* LM head turns its last ``block_size - 1``
   outputs into draft tokens (argmax);
3. the target verifies the whole block in one forward; the longest prefix of drafts equal to its own
   greedy choices is accepted, plus one bonus token (the target's choice after that prefix);
4. the target's cache is cut back to the committed tokens, the drafter's to the committed context, and
   the hidden states of the newly committed tokens become the drafter's new context.

Verification is greedy, so the output must equal plain greedy decoding token for token (`lossless`);
what the drafter decides is only how many tokens each target forward commits.

SpecForge's own `spec_generate` is not called directly: it returns no per-step acceptance, reaches the
embeddings through `target.model` (the Kimi layout nests the language model one level deeper) and crops
caches with the transformers < 5.20 `crop(absolute length)` call, which later releases reject.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EvaluationError(Exception):
    """A checkpoint or model the reference cannot use; the message says what is wrong and what to do."""


# --------------------------------------------------------------------------------------------------
# Target
# --------------------------------------------------------------------------------------------------


class Target:
    """A causal LM from transformers with what DFlash needs: embeddings, LM head, hidden states."""

    def __init__(self, model: Any):
        self.model = model.eval()
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        if self.embed is None or self.lm_head is None:
            raise EvaluationError(
                f"{type(model).__name__} exposes no input embeddings or LM head "
                "(get_input_embeddings/get_output_embeddings): the DFlash drafter shares both with its target"
            )
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.20 names the KV cache argument `cache`; older releases `past_key_values`.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.num_layers = _text_config(model.config).num_hidden_layers
        self.device = next(model.parameters()).device

    @classmethod
    def load(
        cls, path: str | Path, dtype: str = "float32", trust_remote_code: bool = True, device: str = "cpu"
    ) -> Target:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise EvaluationError(
                f"cannot load the target model from {path}: {exc}. Point --target-model at a model "
                "directory with config.json and weights (the demo stage builds one: --tags demo)"
            ) from exc
        return cls(model.to(device))

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any, *, hidden: bool) -> Any:
        """One cached forward over `ids` (shape [1, n]) at `positions`."""
        return self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=hidden,
            **{self._cache_kwarg: cache},
        )


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _text_config(config: Any) -> Any:
    """The language model's config (multimodal wrappers such as Kimi K2.5 nest it under text_config)."""
    text = getattr(config, "text_config", None)
    return text if text is not None else config


def crop_cache(cache: Any, length: int) -> None:
    """Cut a transformers cache back to its first `length` positions.

    A negative argument removes that many positions in every transformers 5.x release (older ones also
    took an absolute length; newer ones refuse it), so this form works across the venvs regen builds.
    """
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """SpecForge's `extract_context_feature`: layer L's output is hidden_states[L + 1] (0: embeddings)."""
    return torch.cat([hidden_states[layer + 1] for layer in layer_ids], dim=-1)


# --------------------------------------------------------------------------------------------------
# Proposers: who fills the block's masked slots
# --------------------------------------------------------------------------------------------------


class Proposer(Protocol):
    """Proposes block_size - 1 tokens after the last committed token."""

    def reset(self) -> None: ...

    def propose(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        """`block` is [1, block_size] (committed token + masks) at positions start .. start+block_size-1;
        `context` the target features of positions not yet shown to the proposer. Returns [block_size-1]."""
        ...


class DFlashProposer:
    """SpecForge's DFlash drafter, drafting a block in one forward with its own KV cache of the context."""

    def __init__(self, drafter: Any, target: Target):
        self.drafter = drafter.eval()
        self.target = target
        self.block_size = int(drafter.block_size)
        self.layer_ids = [int(x) for x in drafter.target_layer_ids]
        self.mask_token_id = drafter.mask_token_id
        self.cache: Any = None
        self.last_logits: torch.Tensor | None = None  # [block_size - 1, vocab] of the last proposal

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    def propose(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        seen = self.cache.get_seq_length()
        positions = torch.arange(seen, start + self.block_size, device=block.device).unsqueeze(0)
        hidden = self.drafter(
            target_hidden=context,
            noise_embedding=self.target.embed(block),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            is_causal=False,
        )
        # The cache keeps the committed context only; the block's keys are recomputed next step.
        crop_cache(self.cache, start)
        logits = self.target.lm_head(hidden[:, -self.block_size + 1 :, :])
        self.last_logits = logits[0]
        return logits.argmax(dim=-1)[0]


class OracleProposer:
    """Proposes the target's own greedy continuation: every draft is accepted (the harness's upper bound)."""

    def __init__(self, continuation: Sequence[int], block_size: int):
        self.continuation = list(continuation)  # prompt + greedy tokens, long enough for the last block
        self.block_size = block_size

    def reset(self) -> None:
        pass

    def propose(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        tokens = self.continuation[start + 1 : start + self.block_size]
        tokens += [int(block[0, -1])] * (self.block_size - 1 - len(tokens))  # past the reference's end
        return torch.tensor(tokens, dtype=torch.long, device=block.device)


# --------------------------------------------------------------------------------------------------
# Loading the drafter
# --------------------------------------------------------------------------------------------------


def drafter_config(checkpoint: str | Path) -> Any:
    """The exported drafter's config (a Qwen3Config carrying block_size and dflash_config)."""
    from transformers import AutoConfig

    path = Path(checkpoint)
    if not (path / "config.json").is_file():
        raise EvaluationError(
            f"{path} has no config.json: pass the drafter directory `specforge export --to hf` wrote "
            "(the train stage's <run>/export), or a checkpoint of your own in that format"
        )
    config = AutoConfig.from_pretrained(str(path))
    dflash = getattr(config, "dflash_config", None) or {}
    missing = [k for k in ("mask_token_id",) if dflash.get(k) is None]
    if getattr(config, "block_size", None) is None:
        missing.append("block_size")
    if missing:
        raise EvaluationError(
            f"{path}/config.json lacks {', '.join(missing)}: it is not a DFlash drafter config "
            "(SpecForge's DFlashDraftModel needs block_size and dflash_config.mask_token_id)"
        )
    return config


def _drafter_class(config: Any) -> type:
    from specforge.modeling.draft import DFlashDraftModel  # noqa: F401  (registers the draft classes)
    from specforge.modeling.draft.registry import DRAFT_REGISTRY

    arch = (getattr(config, "architectures", None) or ["DFlashDraftModel"])[0]
    if arch not in DRAFT_REGISTRY:
        raise EvaluationError(
            f"drafter architecture {arch!r} is not one SpecForge registers: "
            f"{', '.join(sorted(DRAFT_REGISTRY))}"
        )
    return DRAFT_REGISTRY[arch]


def load_drafter(checkpoint: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The trained drafter: SpecForge's class built from config.json, weights loaded strictly.

    A state-dict load rather than `from_pretrained`, as SpecForge's own acceptance benchmark does: it
    fails loudly on any missing or unexpected tensor instead of initialising it silently.
    """
    from safetensors.torch import load_file

    config = drafter_config(checkpoint)
    config._attn_implementation = "sdpa"
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise EvaluationError(f"{checkpoint} holds no *.safetensors weights; export the drafter first")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    model = _drafter_class(config)(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise EvaluationError(
            f"the weights in {checkpoint} do not fit its config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; re-export the checkpoint with the draft config it was trained with"
        )
    return model.to(DTYPES[dtype]).to(device).eval()


def fresh_drafter(checkpoint: str | Path, seed: int, dtype: str = "float32", device: str = "cpu") -> Any:
    """An untrained drafter of the same config: SpecForge's own initialisation, seeded."""
    config = drafter_config(checkpoint)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _drafter_class(config)(config)
    return model.to(DTYPES[dtype]).to(device).eval()


def checkpoint_summary(checkpoint: str | Path) -> dict[str, Any]:
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    dflash = config.get("dflash_config") or {}
    return {
        "block_size": config.get("block_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "mask_token_id": dflash.get("mask_token_id"),
    }


def check_compatible(drafter: Any, target: Target) -> None:
    """The drafter must read layers the target has and emit through an LM head of its vocabulary."""
    layers = [int(x) for x in drafter.target_layer_ids]
    if not layers or max(layers) >= target.num_layers or min(layers) < 0:
        raise EvaluationError(
            f"the drafter reads target layers {layers} but the target has {target.num_layers}: "
            "this checkpoint was trained for another target model"
        )
    width = drafter.fc.in_features
    hidden = target.embed.embedding_dim
    if width != len(layers) * hidden:
        raise EvaluationError(
            f"the drafter expects {width // max(len(layers), 1)}-wide target features, the target's hidden "
            f"size is {hidden}: this checkpoint was trained for another target model"
        )


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


@dataclass
class Decoded:
    tokens: list[int]  # generated tokens only (the prompt excluded), cut after the first stop token
    seconds: float
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification step
    # Per tree budget: the draft tokens a DDTree of that budget would have had accepted at each step.
    tree_accepted: dict[int, list[int]] = field(default_factory=dict)
    # greedy_decode(continue_to=N): the first N greedy tokens, stop tokens and all.
    continuation: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.accepted)


def _cut_at_stop(tokens: list[int], max_new: int, stop_ids: Sequence[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def greedy_decode(
    target: Target,
    prompt: Sequence[int],
    max_new: int,
    stop_ids: Sequence[int] = (),
    continue_to: int = 0,
) -> Decoded:
    """Plain autoregressive greedy decoding with a KV cache: one target forward per token.

    `tokens` and `seconds` are the plain decode (up to `max_new` tokens or a stop token). With
    `continue_to`, the same decode then goes on, stops ignored and untimed, until `continue_to` tokens in
    all (`continuation`): the target's own longer continuation, without decoding the prompt a second time.
    """
    dev = target.device
    began = time.perf_counter()
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=dev)
    cache = target.new_cache()
    positions = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
    logits = target.forward(ids, positions, cache, hidden=False).logits
    out: list[int] = []
    plain: list[int] | None = None
    seconds = 0.0
    while True:
        token = int(logits[0, -1].argmax())
        out.append(token)
        if plain is None and (len(out) >= max_new or token in stop_ids):
            plain, seconds = list(out), time.perf_counter() - began
        if plain is not None and len(out) >= continue_to:
            break
        pos = len(prompt) + len(out) - 1
        step = torch.tensor([[token]], device=dev)
        logits = target.forward(step, torch.tensor([[pos]], device=dev), cache, hidden=False).logits
    return Decoded(tokens=plain, seconds=seconds, continuation=out if continue_to else [])


@torch.inference_mode()
def speculative_decode(
    target: Target,
    proposer: Proposer,
    prompt: Sequence[int],
    *,
    block_size: int,
    mask_token_id: int,
    layer_ids: Sequence[int],
    max_new: int,
    stop_ids: Sequence[int] = (),
    tree_budgets: Sequence[int] = (),
    continuation: Sequence[int] | None = None,
) -> Decoded:
    """DFlash speculative decoding with greedy verification (one step per target forward after prefill).

    With `tree_budgets` (and `continuation`: prompt + the target's greedy tokens, a block longer than the
    output), every step also scores the drafter's per-slot distributions as DDTrees of those node budgets
    and records what greedy verification of each tree would have accepted in the same state.
    """
    from .tree import accepted_depth, build_tree

    topk = max(tree_budgets, default=0)
    dev = target.device
    began = time.perf_counter()
    tree_seconds = 0.0  # DDTree scoring is measurement, not decoding: kept out of the decode's time
    n = len(prompt)
    proposer.reset()
    cache = target.new_cache()
    prompt_ids = torch.tensor([list(prompt)], device=dev)
    prefill = target.forward(prompt_ids, torch.arange(n, device=dev).unsqueeze(0), cache, hidden=True)
    committed = [*prompt, int(prefill.logits[0, -1].argmax())]
    context = context_features(prefill.hidden_states, layer_ids)  # features of positions 0 .. n-1
    accepted_per_step: list[int] = []
    tree_accepted: dict[int, list[int]] = {}
    start = n  # position of the last committed token, the block's first slot
    while len(committed) - n < max_new and not any(t in stop_ids for t in committed[n:]):
        block = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = committed[start]
        block[0, 1:] = proposer.propose(block, context, start)
        logits = getattr(proposer, "last_logits", None)
        if topk and logits is not None and continuation is not None:
            _synchronize(dev)  # the draft's own (asynchronous) work belongs to the decode's time
            tree_began = time.perf_counter()
            probs, ids = logits.float().softmax(dim=-1).topk(min(topk, logits.shape[-1]), dim=-1)
            candidates = [
                list(zip(i.tolist(), p.tolist(), strict=True)) for i, p in zip(ids, probs, strict=True)
            ]
            truth = list(continuation[start + 1 : start + block_size])
            for budget in tree_budgets:
                depth = accepted_depth(build_tree(candidates, budget), truth)
                tree_accepted.setdefault(budget, []).append(depth)
            tree_seconds += time.perf_counter() - tree_began
        positions = torch.arange(start, start + block_size, device=dev).unsqueeze(0)
        verify = target.forward(block, positions, cache, hidden=True)
        posterior = verify.logits[0].argmax(dim=-1)  # the target's greedy token after each block slot
        matches = (block[0, 1:] == posterior[:-1]).long()
        accepted = int(matches.cumprod(dim=0).sum())
        committed += [*block[0, 1 : accepted + 1].tolist(), int(posterior[accepted])]
        accepted_per_step.append(accepted)
        start += accepted + 1
        crop_cache(cache, start)
        context = context_features(verify.hidden_states, layer_ids)[:, : accepted + 1, :]
    return Decoded(
        tokens=_cut_at_stop(committed[n:], max_new, stop_ids),
        seconds=time.perf_counter() - began - tree_seconds,
        accepted=accepted_per_step,
        tree_accepted=tree_accepted,
    )
