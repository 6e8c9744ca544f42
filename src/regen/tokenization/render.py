"""Render a conversation with the model's own chat template, as pieces that know what they are.

How the pieces are found (no regex over rendered text that a special-token string inside a message could
fool):

1. Every non-empty string a message carries (content, reasoning, tool-call ids/names/string arguments,
   the tool result's call id) is replaced by a unique ASCII marker and the conversation is rendered once.
   That *skeleton* is pure template text plus markers, so everything between markers was written by the
   template, and every marker says which message and field it stands for. (Tool declarations and
   tool-call arguments given as objects are serialized by the template and count as template text.)
2. The real conversation is rendered too. The skeleton with the markers substituted back must equal it;
   templates that trim a field (Qwen strips reasoning newlines) are aligned by trying the usual trims of
   that field. The text that gets tokenized is therefore exactly the text the template renders.
3. Turn boundaries come from two probes of the template: the generation prompt ``G`` (what
   ``add_generation_prompt=True`` appends, e.g. ``<|im_assistant|>assistant<|im_middle|><think>`` for
   Kimi in thinking mode) and the end of an assistant turn ``T`` (what follows an assistant's content
   when it is the last message, ``<|im_end|>`` for Kimi). In the template text just before an assistant
   message's first marker, the last occurrence of G's first control token starts the header, which
   extends as far as it agrees with G; supervision starts there. It ends after the first ``T`` that
   follows the message's last marker. (A turn with no marker at all -- reasoning only, dropped by the
   template -- is found the same way between its neighbours.)

What is supervised (loss mask 1): for each assistant turn, everything after the generation prompt through
the end-of-turn token -- the tokens the target model itself produced when it answered that prompt:
reasoning (where rendered), ``</think>``, content, tool calls, ``<|im_end|>``. The role header and the
part of the generation prompt the server wrote (Kimi's ``<think>`` in thinking mode) are 0, as are
system, user and tool turns.

Reasoning (``reasoning=``):
- ``keep``: pass ``reasoning_content`` to the template and train on whatever it renders. Kimi's template
  renders reasoning only for assistant turns after the last plain (tool-call-free) assistant turn, so a
  finished conversation loses all of it -- SpecForge's ``kimi-k2-thinking`` template behaves the same.
- ``last`` (default): the final assistant turn as it was served -- the prompt the server rendered for it
  (``add_generation_prompt=True`` over the earlier messages, so a tool-call chain keeps its reasoning as
  Kimi's template shows it to the model) followed by what the model wrote; if the template dropped the
  final turn's reasoning, it goes back right after the generation prompt:
  ``...<|im_assistant|>assistant<|im_middle|><think>`` + reasoning + ``</think>`` + content + ``<|im_end|>``.
  Placing it needs a generation prompt that ends with an open think tag and a rendered turn that goes on
  with the closing tag; otherwise the row is rejected (``reasoning_unplaceable``). For templates that
  render the final turn's reasoning themselves (Qwen3) and render history the same way in the prompt,
  ``last`` equals ``keep``.
- ``drop``: remove ``reasoning_content`` from every message before rendering.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from regen.tokenization.conversation import Conversation, RowError

REASONING_POLICIES = ("keep", "last", "drop")
TRAIN_TURNS = ("all", "last")


class TemplateError(Exception):
    """The chat template cannot be used for masked training at all (raised once, at start-up)."""


@dataclass(frozen=True)
class Piece:
    text: str
    content: bool  # True: text a message carried (encoded as plain text); False: written by the template
    supervised: bool


@dataclass
class Rendered:
    pieces: list[Piece]
    assistant_turns: int = 0
    supervised_turns: int = 0
    reasoning_turns: int = 0  # assistant turns whose message carries reasoning (before the policy)
    reasoning_rendered: int = 0  # ... whose reasoning the template put into the text
    reasoning_synthesized: int = 0  # 1 when the final turn's reasoning was placed after the generation prompt
    reasoning_dropped: int = 0  # ... whose reasoning is not in the text (template history, or policy drop)
    trimmed_by_template: bool = False  # the template trimmed some field; aligned by trying the usual trims
    messages: list[dict[str, Any]] = field(default_factory=list)  # what was rendered (after the policy)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


@dataclass(frozen=True)
class TemplateShape:
    generation_prompt: str  # G
    header_start: str  # the first control token of G (or its first line when it has none)
    turn_end: str  # T


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _trims(text: str) -> list[str]:
    out: list[str] = []
    for candidate in (
        text,
        text.strip(),
        text.strip("\n"),
        text.lstrip(),
        text.rstrip(),
        text.lstrip("\n"),
        text.rstrip("\n"),
    ):
        if candidate not in out:
            out.append(candidate)
    return out


class ChatRenderer:
    """Renders conversations with `tokenizer.apply_chat_template` into supervised/unsupervised pieces."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning: str = "last",
        train_turns: str = "all",
        think_tags: tuple[str, str] = ("<think>", "</think>"),
        control_tokens: Sequence[str] | None = None,
    ):
        if reasoning not in REASONING_POLICIES:
            raise ValueError(f"reasoning must be one of {REASONING_POLICIES}, not {reasoning!r}")
        if train_turns not in TRAIN_TURNS:
            raise ValueError(f"train_turns must be one of {TRAIN_TURNS}, not {train_turns!r}")
        kwargs = dict(chat_template_kwargs or {})
        for reserved in ("add_generation_prompt", "tokenize", "tools", "continue_final_message"):
            if reserved in kwargs:
                raise TemplateError(f"chat template kwarg {reserved!r} is set by the job itself; remove it")
        if getattr(tokenizer, "chat_template", None) in (None, ""):
            raise TemplateError(
                "the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        self._tokenizer = tokenizer
        self.kwargs = kwargs
        self.reasoning = reasoning
        self.train_turns = train_turns
        self.think_open, self.think_close = think_tags
        controls = list(control_tokens) if control_tokens is not None else list(tokenizer.get_added_vocab())
        self._control_re = (
            re.compile("|".join(re.escape(t) for t in sorted(controls, key=len, reverse=True)))
            if controls
            else None
        )
        self._new_nonce()
        self.shape = self._probe()

    # ------------------------------------------------------------------ template calls

    def _new_nonce(self) -> None:
        self._skeletons: dict[tuple[str, bool], str] = {}
        self._nonce = f"RGNSLOT{secrets.token_hex(6)}N"
        self._marker_re = re.compile(re.escape(self._nonce) + r"(\d+)Z")

    def _apply(self, messages: list[dict[str, Any]], tools: list[Any] | None, generation_prompt: bool) -> str:
        try:
            out = self._tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **self.kwargs
            )
        except Exception as exc:  # a template's raise_exception(), a jinja error on odd input
            raise RowError(
                "template_error", f"the chat template failed: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(out, str):
            raise RowError("template_error", f"apply_chat_template returned {type(out).__name__}, not text")
        return out

    def _skeleton(
        self, skeleton_messages: list[dict[str, Any]], tools: list[Any] | None, generation_prompt: bool
    ) -> str:
        """Render a skeleton, remembering it: conversations of one shape (same roles, same fields filled, same
        tools) have the same skeleton, so a dataset costs one template render per conversation (the real
        text), not three. A template that looks at message text cannot fool this: the real text must still
        match the skeleton with the markers filled in, or the row is aligned or rejected."""
        key = (json.dumps([skeleton_messages, tools], sort_keys=True, default=str), generation_prompt)
        skeleton = self._skeletons.get(key)
        if skeleton is None:
            skeleton = self._apply(skeleton_messages, tools, generation_prompt)
            if len(self._skeletons) >= 1024:
                self._skeletons.pop(next(iter(self._skeletons)))
            self._skeletons[key] = skeleton
        return skeleton

    def _marker(self, slots: list[tuple[int, str]], owner: int, text: str) -> str:
        slots.append((owner, text))
        return f"{self._nonce}{len(slots) - 1}Z"

    def _skeleton_messages(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[tuple[int, str]], dict[int, int]]:
        """Messages with every non-empty string field replaced by a marker; (skeleton, slots, reasoning slot
        per message). Empty strings stay empty: templates test them (``{% if content %}``)."""
        slots: list[tuple[int, str]] = []
        reasoning_slot: dict[int, int] = {}
        out = []
        for i, message in enumerate(messages):
            skel = dict(message)
            for key in ("content", "tool_call_id"):
                if isinstance(message.get(key), str) and message[key]:
                    skel[key] = self._marker(slots, i, message[key])
            if message.get("reasoning_content"):
                skel["reasoning_content"] = self._marker(slots, i, message["reasoning_content"])
                reasoning_slot[i] = len(slots) - 1
            if message.get("tool_calls"):
                calls = []
                for call in message["tool_calls"]:
                    function = dict(call["function"])
                    function["name"] = self._marker(slots, i, function["name"])
                    if isinstance(function["arguments"], str) and function["arguments"]:
                        function["arguments"] = self._marker(slots, i, function["arguments"])
                    new_call = {**call, "function": function}
                    if call.get("id"):
                        new_call["id"] = self._marker(slots, i, call["id"])
                    calls.append(new_call)
                skel["tool_calls"] = calls
            out.append(skel)
        return out, slots, reasoning_slot

    def _split(self, skeleton: str) -> list[tuple[int, int, int | None]]:
        """(start, end, slot index or None for template text) covering the skeleton."""
        parts: list[tuple[int, int, int | None]] = []
        pos = 0
        for match in self._marker_re.finditer(skeleton):
            if match.start() > pos:
                parts.append((pos, match.start(), None))
            parts.append((match.start(), match.end(), int(match.group(1))))
            pos = match.end()
        if pos < len(skeleton):
            parts.append((pos, len(skeleton), None))
        return parts

    # ------------------------------------------------------------------ probes

    def _first_control(self, text: str) -> str:
        if self._control_re is not None:
            match = self._control_re.match(text)
            if match:
                return match.group(0)
        line = text.split("\n", 1)[0]
        return line if line.strip() else text

    def _probe(self) -> TemplateShape:
        user = {"role": "user", "content": f"{self._nonce}0Z"}
        assistant = {"role": "assistant", "content": f"{self._nonce}1Z"}
        try:
            prompt = self._apply([user], None, False)
            with_generation = self._apply([user], None, True)
            pair = self._apply([user, assistant], None, False)
        except RowError as exc:
            raise TemplateError(
                f"the chat template cannot render a user/assistant exchange: {exc.detail}"
            ) from None
        if not with_generation.startswith(prompt) or len(with_generation) == len(prompt):
            raise TemplateError(
                "add_generation_prompt=True does not append an assistant header to the prompt, so assistant "
                "turns cannot be told apart; this template is not supported"
            )
        generation_prompt = with_generation[len(prompt) :]
        end = pair.find(f"{self._nonce}1Z")
        if end < 0:
            raise TemplateError("the chat template does not render an assistant message's content")
        turn_end = pair[end + len(f"{self._nonce}1Z") :]
        if not turn_end:
            raise TemplateError(
                "the chat template writes nothing after an assistant turn (no end-of-turn token)"
            )
        return TemplateShape(generation_prompt, self._first_control(generation_prompt), turn_end)

    # ------------------------------------------------------------------ rendering

    def render(self, conversation: Conversation) -> Rendered:
        messages = conversation.messages
        for _ in range(3):  # a marker colliding with real text needs a fresh nonce (never, in practice)
            if not any(
                self._nonce in (m.get("content") or "") or self._nonce in (m.get("reasoning_content") or "")
                for m in messages
            ):
                break
            self._new_nonce()
        result = Rendered(pieces=[])
        result.reasoning_turns = sum(
            1 for m in messages if m["role"] == "assistant" and m.get("reasoning_content")
        )
        if self.reasoning == "drop":
            messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
        result.messages = messages
        result.assistant_turns = sum(1 for m in messages if m["role"] == "assistant")
        skeleton_messages, slots, reasoning_slot = self._skeleton_messages(messages)
        full = self._analyze(messages, skeleton_messages, slots, conversation.tools, generation_prompt=False)

        final = len(messages) - 1
        view = full
        if self.reasoning == "last" and messages[final]["role"] == "assistant" and final > 0:
            view = self._serving_view(
                messages, skeleton_messages, slots, reasoning_slot, conversation.tools, full
            )
            result.reasoning_synthesized = int(
                view is not full
                and final in reasoning_slot
                and reasoning_slot[final] not in full.present_after_header
            )
        present = {slots[idx][0] for idx in view.present_slots if idx in reasoning_slot.values()}
        for k, m in enumerate(messages):
            if (
                m["role"] == "assistant"
                and not m["content"].strip()
                and not m.get("tool_calls")
                and k not in present
            ):
                raise RowError(
                    "empty_content",
                    f"assistant message {k} has only reasoning, and with --reasoning "
                    f"{self.reasoning} the template renders none of it",
                )
        result.reasoning_rendered = len(present) - result.reasoning_synthesized
        result.reasoning_dropped = (
            result.reasoning_turns - result.reasoning_rendered - result.reasoning_synthesized
        )
        result.trimmed_by_template = view.trimmed

        spans = view.spans[-1:] if self.train_turns == "last" else view.spans
        result.supervised_turns = len(spans)
        result.pieces = self._pieces(view.parts, view.texts, view.skeleton, spans)
        return result

    def _analyze(
        self,
        messages: list[dict[str, Any]],
        skeleton_messages: list[dict[str, Any]],
        slots: list[tuple[int, str]],
        tools: list[Any] | None,
        generation_prompt: bool,
        skeleton: str | None = None,
    ) -> _View:
        """Render skeleton and real text, align them, and find every assistant turn's supervised span."""
        if skeleton is None:
            skeleton = self._skeleton(skeleton_messages, tools, generation_prompt)
        parts = self._split(skeleton)
        real = self._apply(messages, tools, generation_prompt)
        texts = self._slot_texts(skeleton, parts, slots, real)
        if texts is None:
            typed = sorted(
                {m.group(0) for _, text in slots for m in self._control_re.finditer(text)}
                if self._control_re is not None
                else set()
            )
            because = (
                f" (a message holds {', '.join(typed)}, which the template treats as its own markup)"
                if typed
                else ""
            )
            raise RowError(
                "template_mismatch",
                "the chat template changes message text in a way that cannot be "
                f"aligned (beyond trimming){because}, so the loss mask cannot be placed exactly",
            )
        occurrences = [idx for _, _, idx in parts if idx is not None]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for start, end, idx in parts:
            if idx is not None:
                first.setdefault(slots[idx][0], start)
                last[slots[idx][0]] = end
        ordered = sorted(first)
        for a, b in itertools.pairwise(ordered):
            if last[a] > first[b]:
                raise RowError("template_mismatch", f"the chat template interleaves messages {a} and {b}")
        view = _View(
            skeleton=skeleton,
            parts=parts,
            texts=texts,
            present_slots=set(occurrences),
            trimmed=any(t != slots[idx][1] for t, idx in zip(texts, occurrences, strict=True)),
        )
        for k in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
            before = [last[i] for i in ordered if i < k]
            after = [first[i] for i in ordered if i > k]
            gap_start = before[-1] if before else 0
            gap_end = after[0] if after else len(skeleton)
            # A turn without markers (only reasoning, which the template dropped) is found between its
            # neighbours: its header is the last one there, as the next message is never an assistant's.
            anchor, anchor_end = first.get(k, gap_end), last.get(k, gap_start)
            pos = skeleton.rfind(self.shape.header_start, gap_start, anchor)
            if pos < 0:
                raise RowError(
                    "template_mismatch", f"no assistant header before message {k} in the rendered text"
                )
            header_end = pos + _common_prefix_len(self.shape.generation_prompt, skeleton[pos:anchor])
            end = skeleton.find(self.shape.turn_end, max(anchor_end, header_end), gap_end)
            if end < 0:
                raise RowError(
                    "template_mismatch", f"no end-of-turn {self.shape.turn_end!r} after message {k}"
                )
            view.spans.append((header_end, end + len(self.shape.turn_end)))
            view.headers.append((pos, header_end))
        view.present_after_header = {
            idx for start, _, idx in parts if idx is not None and view.spans and start >= view.spans[-1][0]
        }
        return view

    def _serving_view(
        self,
        messages: list[dict[str, Any]],
        skeleton_messages: list[dict[str, Any]],
        slots: list[tuple[int, str]],
        reasoning_slot: dict[int, int],
        tools: list[Any] | None,
        full: _View,
    ) -> _View:
        """The final turn as it was served: the prompt the server rendered (generation prompt included) and
        what the model wrote after it, with the reasoning back inside the think block the prompt opened.

        Falls back to the full rendering when the final turn does not start with the whole generation
        prompt (then there is no seam to join at)."""
        final = len(messages) - 1
        header_at, header_end = full.headers[-1]
        if header_end - header_at != len(self.shape.generation_prompt):
            if final in reasoning_slot and reasoning_slot[final] not in full.present_slots:
                raise RowError("reasoning_unplaceable", self._unplaceable)
            return full
        prompt_skeleton = self._skeleton(skeleton_messages[:final], tools, True)
        tail = full.skeleton[header_end:]
        reasoning_missing = final in reasoning_slot and reasoning_slot[final] not in full.present_after_header
        if reasoning_missing and not (
            prompt_skeleton.rstrip().endswith(self.think_open) and tail.lstrip().startswith(self.think_close)
        ):
            raise RowError("reasoning_unplaceable", self._unplaceable)
        if prompt_skeleton == full.skeleton[:header_end]:
            # Prefix-stable here (the usual case): the full rendering up to the seam is the served prompt.
            if not reasoning_missing:
                return full
            prompt = _View(
                skeleton=prompt_skeleton,
                parts=[],
                present_slots=set(),
                trimmed=full.trimmed,
                texts=[
                    t
                    for (start, _, _), t in zip(full.occurrences, full.texts, strict=True)
                    if start < header_end
                ],
            )
            prompt.spans, prompt.headers = full.spans[:-1], full.headers[:-1]
        else:
            prompt = self._analyze(
                messages[:final],
                skeleton_messages[:final],
                slots,
                tools,
                generation_prompt=True,
                skeleton=prompt_skeleton,
            )
        marker = f"{self._nonce}{reasoning_slot[final]}Z" if reasoning_missing else ""
        skeleton = prompt_skeleton + marker + tail
        parts = self._split(skeleton)
        # Texts: the prompt's, the reasoning, then the full rendering's for the markers after the seam.
        tail_texts = [
            t for (start, _, _), t in zip(full.occurrences, full.texts, strict=True) if start >= header_end
        ]
        texts = [
            *prompt.texts,
            *([slots[reasoning_slot[final]][1]] if reasoning_missing else []),
            *tail_texts,
        ]
        seam = len(prompt.skeleton)
        turn_end = seam + len(marker) + (full.spans[-1][1] - header_end)
        view = _View(
            skeleton=skeleton,
            parts=parts,
            texts=texts,
            present_slots={idx for _, _, idx in parts if idx is not None},
            trimmed=prompt.trimmed or full.trimmed,
        )
        view.spans = [*prompt.spans, (seam, turn_end)]
        view.headers = [*prompt.headers, (seam - len(self.shape.generation_prompt), seam)]
        return view

    @property
    def _unplaceable(self) -> str:
        return (
            f"--reasoning last: the generation prompt leaves no {self.think_open} block open before the "
            f"final answer (thinking switched off?), so its reasoning has no place; use --reasoning drop"
        )

    @staticmethod
    def _slot_texts(
        skeleton: str, parts: list[tuple[int, int, int | None]], slots: list[tuple[int, str]], real: str
    ) -> list[str] | None:
        """The real text of each marker occurrence; None when the skeleton cannot be aligned with `real`."""
        originals = [slots[idx][1] for _, _, idx in parts if idx is not None]
        it = iter(originals)
        if "".join(skeleton[s:e] if idx is None else next(it) for s, e, idx in parts) == real:
            return originals  # the template copied every field verbatim (the usual case)
        # Walk the template pieces as anchors; a field may have been trimmed by the template.
        out: list[str] = []
        pos = 0
        for n, (start, end, idx) in enumerate(parts):
            if idx is None:
                if not real.startswith(skeleton[start:end], pos):
                    return None
                pos += end - start
                continue
            following = parts[n + 1] if n + 1 < len(parts) else None
            for candidate in _trims(slots[idx][1]):
                stop = pos + len(candidate)
                if not real.startswith(candidate, pos):
                    continue
                if following is None:
                    if stop == len(real):
                        break
                elif following[2] is not None or real.startswith(skeleton[following[0] : following[1]], stop):
                    break
            else:
                return None
            out.append(candidate)
            pos = stop
        return out if pos == len(real) else None

    @staticmethod
    def _pieces(
        parts: list[tuple[int, int, int | None]],
        texts: list[str],
        skeleton: str,
        spans: list[tuple[int, int]],
    ) -> list[Piece]:
        cuts = sorted({b for span in spans for b in span})

        def supervised(at: int) -> bool:
            return any(h <= at < e for h, e in spans)

        pieces: list[Piece] = []

        def add(text: str, content: bool, sup: bool) -> None:
            if not text:
                return
            if pieces and pieces[-1].content == content and pieces[-1].supervised == sup:
                pieces[-1] = Piece(pieces[-1].text + text, content, sup)
            else:
                pieces.append(Piece(text, content, sup))

        k = 0
        for start, end, idx in parts:
            if idx is not None:
                add(texts[k], True, supervised(start))
                k += 1
                continue
            bounds = [start, *[c for c in cuts if start < c < end], end]
            for a, b in itertools.pairwise(bounds):
                add(skeleton[a:b], False, supervised(a))
        return pieces


@dataclass
class _View:
    """One rendering of a conversation: skeleton, its parts, the real text per marker, and spans."""

    skeleton: str
    parts: list[tuple[int, int, int | None]]
    texts: list[str]
    present_slots: set[int]
    trimmed: bool
    spans: list[tuple[int, int]] = field(default_factory=list)  # (supervision start, turn end) per assistant
    headers: list[tuple[int, int]] = field(default_factory=list)  # (header start, generation prompt end)
    present_after_header: set[int] = field(default_factory=set)  # markers inside the final assistant turn

    @property
    def occurrences(self) -> list[tuple[int, int, int | None]]:
        return [p for p in self.parts if p[2] is not None]
