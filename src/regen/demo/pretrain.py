"""A short CPU pre-training of the demo model on the demo corpus, so its greedy outputs have structure.

A target with random weights emits token salad that no drafter can learn to predict: every drafter,
trained or not, then scores an acceptance length of 1.0 and the evaluate stage measures nothing. So the
builder trains the tiny model for a few hundred steps on text the project ships (``corpus.txt``):

- every paragraph of the corpus as plain text, ending in ``[EOS]``;
- chat turns made from it with the model's own chat template: each ``User:``/``Assistant:`` pair of the
  corpus, and each prose paragraph of two or more sentences (its first sentence as the user turn, the rest
  as the answer). Every turn is rendered twice, once with thinking on (the first sentence of the answer as
  the reasoning inside ``<think>...</think>``) and once with thinking off, so the model answers a chat
  prompt in both of the template's modes and ends its turn with ``<|im_end|>``.

What it learns is a tiny model's imitation of a 12 KB corpus: fluent-looking fragments of it, recalled
and recombined, whatever the prompt asks. It cannot do arithmetic or know facts it never saw, and it is
not meant to; what matters is that its continuations follow patterns a drafter can learn.

Deterministic: the initial weights are the seeded per-tensor draws of ``regen.demo.weights``, batches are
drawn from a generator seeded with the spec's seed, torch runs with ``spec.pretrain_threads`` threads and
deterministic algorithms, so one machine always writes the same bytes (other CPUs may round differently;
the builder's cache is keyed by its inputs, never by the bytes it wrote).

The model is transformers' own DeepSeek-V3 (what the demo's remote code wraps), trained in float32 and
stored in the checkpoint's dtypes (bfloat16; the router's correction bias float32).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from regen.demo import bpe
from regen.demo import spec as spec_module
from regen.demo.spec import DemoSpec

log = logging.getLogger("regen.demo.pretrain")

TEXT_PREFIX = "language_model."
_EXPERT_KEY = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
# The corpus's dialogues: "User: ...\nAssistant: ..." and the Chinese ones with full-width colons.
_DIALOGUE = re.compile(
    "^(?:User|\u7528\u6237)[:\uff1a]\\s*(?P<q>.+?)\n(?:Assistant|\u52a9\u624b)[:\uff1a]\\s*(?P<a>.+)$", re.S
)
# A sentence ends at . ! ? or 。 followed by whitespace (or, for 。, by anything).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=。)")
THINKING_OFF_EVERY = 3


# --------------------------------------------------------------------------------------------------
# Training text
# --------------------------------------------------------------------------------------------------


def corpus_paragraphs(text: str) -> list[str]:
    """The corpus split at blank lines, without its ``#`` header comment."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip("\n")
        if block.strip() and not block.lstrip().startswith("#"):
            paragraphs.append(block)
    return paragraphs


def split_first_sentence(text: str) -> tuple[str, str] | None:
    """(first sentence, the rest) of a prose paragraph, or None when it has a single sentence."""
    parts = _SENTENCE_END.split(text.strip(), maxsplit=1)
    if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
        return None
    return parts[0].strip(), parts[1].strip()


def _is_prose(paragraph: str) -> bool:
    """Code, configuration and log lines stay plain text: they have no question/answer shape."""
    first = paragraph.lstrip()
    return not (
        first.startswith(("def ", "class ", "for ", "- name:", "{", "SELECT", "Error:", "  "))
        or "\n    " in paragraph
    )


def dialogues(paragraphs: list[str]) -> list[tuple[str, str]]:
    """(user turn, answer) pairs: the corpus's own dialogues, then its prose paragraphs split in two."""
    pairs = []
    for paragraph in paragraphs:
        match = _DIALOGUE.match(paragraph.strip())
        if match:
            pairs.append((match["q"].strip(), match["a"].strip()))
        elif _is_prose(paragraph):
            split = split_first_sentence(paragraph)
            if split:
                pairs.append(split)
    return pairs


def chat_renderer(template_text: str):
    """The model's chat template, rendered the way transformers renders it (sandboxed jinja2)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = environment.from_string(template_text)

    def render(messages: list[dict[str, str]], **kwargs: Any) -> str:
        return template.render(messages=messages, **kwargs)

    return render


def chat_turn(render, question: str, answer: str, *, thinking: bool) -> str:
    """A whole chat sample: the prompt as the template renders it for generation, then the answer.

    With thinking on, the generation prompt leaves ``<think>`` open; the first sentence of the answer
    becomes the reasoning and the rest the visible answer (the shape the tokenize stage trains on).
    """
    prompt = render([{"role": "user", "content": question}], add_generation_prompt=True, thinking=thinking)
    body = answer
    if thinking:
        split = split_first_sentence(answer)
        reasoning, body = split if split else ("", answer)
        body = f"{reasoning}</think>{body}"
    return f"{prompt}{body}<|im_end|>"


def training_documents(corpus: str, template_text: str) -> list[str]:
    """Every document the demo model is pre-trained on, in a fixed order."""
    render = chat_renderer(template_text)
    paragraphs = corpus_paragraphs(corpus)
    documents = [f"{paragraph}[EOS]" for paragraph in paragraphs]
    for index, (question, answer) in enumerate(dialogues(paragraphs)):
        documents.append(chat_turn(render, question, answer, thinking=True))
        # Thinking off only for every third turn: its prompt ends in `<think></think>`, and were both modes
        # equally common the likeliest token after an open `<think>` would be `</think>`, i.e. no reasoning.
        if index % THINKING_OFF_EVERY == THINKING_OFF_EVERY - 1:
            documents.append(chat_turn(render, question, answer, thinking=False))
    return documents


def encoder(spec: DemoSpec, tiktoken_file: Path):
    """The demo tokenizer as a tiktoken Encoding: the BPE ranks the builder wrote and the special ids."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from regen.demo.model_files.tokenization_kimi import PAT_STR

    specials = {content: token_id for token_id, content in spec_module.special_tokens(spec).items()}
    return tiktoken.Encoding(
        name="regen-demo",
        pat_str=PAT_STR,
        mergeable_ranks=load_tiktoken_bpe(str(tiktoken_file)),
        special_tokens=specials,
    )


def token_stream(spec: DemoSpec, model_dir: Path) -> list[int]:
    """The training documents of ``model_dir`` (its tokenizer and chat template) as one id stream."""
    encoding = encoder(spec, model_dir / "tiktoken.model")
    template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    ids: list[int] = []
    for document in training_documents(bpe.corpus_text(), template):
        ids += encoding.encode(document, allowed_special="all")
    return ids


# --------------------------------------------------------------------------------------------------
# Checkpoint keys <-> transformers' DeepSeek-V3 module
# --------------------------------------------------------------------------------------------------


def to_module_state(tensors: dict[str, Any], num_experts: int) -> dict[str, Any]:
    """Checkpoint tensors (``language_model.*``, one tensor per expert) as DeepseekV3ForCausalLM's state
    dict: prefix dropped, experts stacked (``gate_up_proj`` = [gate; up] per expert, ``down_proj``)."""
    import torch

    state: dict[str, Any] = {}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for key, value in tensors.items():
        if not key.startswith(TEXT_PREFIX):
            raise ValueError(f"checkpoint key {key!r} is not under {TEXT_PREFIX!r}")
        name = key[len(TEXT_PREFIX) :]
        match = _EXPERT_KEY.match(name)
        if match:
            experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = value
        else:
            state[name] = value
    for prefix, by_index in experts.items():
        if sorted(by_index) != list(range(num_experts)):
            raise ValueError(f"{prefix}: expected experts 0..{num_experts - 1}, found {sorted(by_index)}")
        ordered = [by_index[index] for index in range(num_experts)]
        fused = [torch.cat([expert["gate_proj"], expert["up_proj"]]) for expert in ordered]
        state[f"{prefix}.gate_up_proj"] = torch.stack(fused)
        state[f"{prefix}.down_proj"] = torch.stack([e["down_proj"] for e in ordered])
    return state


def to_checkpoint_tensors(state: dict[str, Any], intermediate: int) -> dict[str, Any]:
    """The inverse of ``to_module_state``: one tensor per expert again, under ``language_model.``."""
    tensors: dict[str, Any] = {}
    for name, value in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for index, fused in enumerate(value):
                tensors[f"{TEXT_PREFIX}{prefix}.{index}.gate_proj.weight"] = fused[:intermediate]
                tensors[f"{TEXT_PREFIX}{prefix}.{index}.up_proj.weight"] = fused[intermediate:]
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for index, down in enumerate(value):
                tensors[f"{TEXT_PREFIX}{prefix}.{index}.down_proj.weight"] = down
        else:
            tensors[f"{TEXT_PREFIX}{name}"] = value
    return tensors


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _torch_settings(threads: int) -> Iterator[None]:
    """Fixed threads and deterministic kernels while training; the caller's settings afterwards."""
    import torch

    old_threads = torch.get_num_threads()
    old_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(old_deterministic)
        torch.set_num_threads(old_threads)


def learning_rate(spec: DemoSpec, step: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to a tenth of the peak."""
    total = max(spec.pretrain_steps, 1)
    warmup = max(total // 10, 1)
    if step < warmup:
        return spec.pretrain_learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return spec.pretrain_learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build_module(spec: DemoSpec):
    """transformers' DeepseekV3ForCausalLM for the demo's text config (float32, SDPA attention)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**spec_module.text_config(spec))
    config._attn_implementation = "sdpa"
    return DeepseekV3ForCausalLM(config).float()


def pretrain(spec: DemoSpec, tensors: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """Train from ``tensors`` (checkpoint keys) on the corpus; return the trained tensors, same keys,
    shapes and dtypes. ``model_dir`` holds the tokenizer and chat template the builder already wrote."""
    import torch

    dtypes = {key: value.dtype for key, value in tensors.items()}
    ids = torch.tensor(token_stream(spec, model_dir), dtype=torch.long)
    window = spec.pretrain_seq_len + 1
    if len(ids) < window:
        raise ValueError(
            f"the demo corpus has {len(ids)} tokens, fewer than pretrain_seq_len + 1 = {window}: "
            "add text to src/regen/demo/corpus.txt or lower pretrain_seq_len"
        )
    with _torch_settings(spec.pretrain_threads):
        model = build_module(spec)
        state = to_module_state({k: v.float() for k, v in tensors.items()}, spec.n_routed_experts)
        model.load_state_dict(state, strict=True)
        model.train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=spec.pretrain_learning_rate, betas=(0.9, 0.95), weight_decay=0.0
        )
        generator = torch.Generator().manual_seed(spec.seed)
        offsets = torch.arange(window)
        for step in range(spec.pretrain_steps):
            starts = torch.randint(
                0, len(ids) - window + 1, (spec.pretrain_batch_size, 1), generator=generator
            )
            batch = ids[starts + offsets]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(spec, step)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % 50 == 0 or step == spec.pretrain_steps - 1:
                log.info("pre-training step %d/%d: loss %.3f", step + 1, spec.pretrain_steps, loss.item())
        trained = {k: v.detach() for k, v in model.state_dict().items()}
    out = to_checkpoint_tensors(trained, spec.moe_intermediate_size)
    missing, extra = sorted(set(dtypes) - set(out)), sorted(set(out) - set(dtypes))
    if missing or extra:
        raise ValueError(
            f"pre-training changed the checkpoint keys: missing {missing[:3]}, extra {extra[:3]}"
        )
    return {key: out[key].to(dtypes[key]).contiguous() for key in dtypes}
