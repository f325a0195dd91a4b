"""The MiniLM text encoder as an ExecuTorch program: the text side of an edit without Python.

On the device the prompt becomes the DiT's text input in two native steps (issue 31):
``sakura_native.Tokenizer`` (C++ WordPiece over the model folder's ``vocab.txt``) gives
the ids and attention mask that ``dit/text.py``'s Hugging Face tokenizer gives, and this
module's program, run by ``sakura_native.TextEncoder`` through the C++ runtime's
``CompiledGraph``, gives what :meth:`sakura.dit.text.TextEncoder.encode` returns: the
``last_hidden_state`` ``[T, 384]`` of the lower-cased prompt padded to ``T = 16`` tokens
(pad positions included: the DiT takes all ``T``).

:class:`EncoderGraph` is the model ``dit/text.py`` loads (the same folder,
:func:`~sakura.dit.text.minilm_dir`), loaded with eager attention (an additive mask; the
default SDPA path exports its masked softmax as ``where`` / ``any`` / ``logical_not`` ops
outside the delegate), as ``ids, mask float32 [1, T] -> float32 [1, T, D]``: the C++ graph
runner's tensors are float32, ids below 2^24 are exact, and the graph casts them back to
int64 for the embedding lookup (``token_type_ids`` are zeros, as the tokenizer gives for
one sentence). It is exported with static shapes through
:func:`~sakura.edge.backends.executorch_backend.lower` (``torch.export`` ->
``to_edge_transform_and_lower(XnnpackPartitioner)``, fp32). The linear layers, attention
and GELU run in XNNPACK; the embedding gathers, the layer norms (XNNPACK has no layer
norm) and the mask arithmetic run on ExecuTorch's portable kernels (``delegation.json``).

:func:`compiled_text_encoder` keeps the program under the compiled-artifact cache
(``sakura.cachedir``: ``compiled/text_encoder/<name>/``), keyed by the weights' and
vocabulary's sha256, ``T`` and the exporter's versions, with a copy of ``vocab.txt`` beside
it: the folder is what a device needs for the text side.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sakura.dit.templates import load_catalog
from sakura.dit.text import minilm_dir
from sakura.edge.backends.base import default_cache_dir
from sakura.edge.backends.delegation import XnnpackDelegation
from sakura.edge.backends.executorch_backend import lower

from sakura.atomic import publish_folder
from sakura.digest import file_sha256

TEXT_GRAPH_FORMAT = 1
PTE_NAME = "text_encoder.pte"
VOCAB_NAME = "vocab.txt"
KEY_NAME = "key.json"


def load_minilm() -> torch.nn.Module:
    """The BertModel of :func:`minilm_dir` (dit/text.py's weights), eager attention, eval."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return AutoModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()
    finally:
        if shown:
            hf_logging.enable_progress_bar()


class EncoderGraph(torch.nn.Module):
    """``ids, mask float32 [1, T] -> last_hidden_state float32 [1, T, D]``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        input_ids = ids.to(torch.long)
        out = self.model(input_ids=input_ids, attention_mask=mask.to(torch.long),
                         token_type_ids=torch.zeros_like(input_ids))
        return out.last_hidden_state


@dataclass(frozen=True)
class TextEncoderProgram:
    """A compiled text encoder: the ``.pte``, its vocabulary and how it was made."""

    folder: Path
    max_tokens: int
    export_s: float           # the export's wall time (when the folder was written)
    exported: bool            # True: this call exported it; False: found in the cache
    delegation: XnnpackDelegation

    @property
    def pte(self) -> Path:
        return self.folder / PTE_NAME

    @property
    def vocab(self) -> Path:
        return self.folder / VOCAB_NAME


def text_encoder_key(max_tokens: int = 16) -> dict[str, object]:
    """What the program depends on, and its digest (``key["digest"]``)."""
    from importlib.metadata import version

    folder = minilm_dir()
    doc: dict[str, object] = {
        "weights_sha256": file_sha256(folder / "model.safetensors"),
        "config_sha256": file_sha256(folder / "config.json"),
        "vocab_sha256": file_sha256(folder / VOCAB_NAME),
        "max_tokens": int(max_tokens), "format": TEXT_GRAPH_FORMAT,
        "executorch": version("executorch"), "torch": torch.__version__,
        "transformers": version("transformers"), "attention": "eager", "dtype": "fp32",
    }
    doc["digest"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return doc


def export_text_encoder(path: Path, max_tokens: int = 16) -> XnnpackDelegation:
    """Write the XNNPACK-lowered ``.pte`` of :class:`EncoderGraph` for ``[1, max_tokens]``
    to ``path``; returns the delegation info."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 ([CLS] and [SEP]), got {max_tokens}")
    graph = EncoderGraph(load_minilm()).eval()
    ids = torch.zeros(1, max_tokens)
    ids[0, 0], ids[0, 1] = 101, 102  # [CLS] [SEP] [PAD]...: any ids trace the same graph
    mask = torch.zeros(1, max_tokens)
    mask[0, :2] = 1
    pte, delegation = lower(graph, (ids, mask))
    Path(path).write_bytes(pte)
    return delegation


def compiled_text_encoder(max_tokens: int = 16, cache_dir: Path | None = None
                          ) -> TextEncoderProgram:
    """The cached text encoder program for ``max_tokens``: loaded from
    ``<cache_dir>/text_encoder/`` (default: the compiled-artifact cache), else exported
    there first (about a minute on this host) and published by rename."""
    key = text_encoder_key(max_tokens)
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "text_encoder"
    folder = root / f"minilm-t{max_tokens}-{str(key['digest'])[:16]}"
    def current(_: Path) -> TextEncoderProgram | None:
        try:
            meta = json.loads((folder / KEY_NAME).read_text())
            if meta.get("digest") == key["digest"] and (folder / PTE_NAME).is_file():
                return TextEncoderProgram(folder, max_tokens, float(meta["export_s"]), False,
                                          XnnpackDelegation.read(folder))
        except (OSError, ValueError, KeyError):
            pass
        return None

    found = current(folder)
    if found is not None:
        return found
    made: dict[str, Any] = {}

    def fill(tmp: Path) -> None:
        t0 = time.perf_counter()
        made["delegation"] = export_text_encoder(tmp / PTE_NAME, max_tokens)
        made["export_s"] = time.perf_counter() - t0
        made["delegation"].write(tmp)
        shutil.copyfile(minilm_dir() / VOCAB_NAME, tmp / VOCAB_NAME)
        (tmp / KEY_NAME).write_text(json.dumps(
            {**key, "export_s": round(made["export_s"], 2)}, indent=1))

    publish_folder(folder, fill, current=lambda p: current(p) is not None)
    export_s, delegation = made["export_s"], made["delegation"]
    return TextEncoderProgram(folder, max_tokens, round(export_s, 2), True, delegation)


# The prompts the native text side is checked on (tests/edge/test_text_encoder_native.py,
# scripts/text_encoder_check.py) besides every prompt of the shipped catalog: accents and
# other scripts, case, punctuation, digits, CJK, emoji, invisible and control characters,
# truncation, prompts that are empty after cleaning.
HARD_PROMPTS: tuple[str, ...] = (
    "café", "naïve", "Ångström", "Zoë", "crème brûlée à la française", "São Paulo",
    "Façade with a résumé", "ÉCOLE ÉLÉMENTAIRE", "Dvořák in Plzeň", "Łódź and Kraków",
    "Straße", "İstanbul, Iğdır", "ΟΔΟΣ ΣΟΦΙΑΣ", "σοφία, ΣΟΦΟΣ.", "Москва, Красная площадь",
    "A Man In A TuXeDo", "RED apple ON a GREEN leaf", "McDonald's iPhone",
    "people & body: man technologist: dark skin tone!!!", "what?! (really) [yes] {no}",
    "a/b\\c|d_e-f+g=h*i^j~k`l@m#n$o%p", "«quoted» „German“ “curly” ‘single’ — dash – en",
    "state-of-the-art, well-known", "3.14159 x 2 = 6.28318", "2026-12-04 at 10:30pm",
    "room 101, floor 7B, 1st & 2nd", "x² + y³ ≥ ½ ¼", "①②③ Ⅻ",
    "野口里佳 Noguchi Rika", "一只红色的苹果", "東京タワーの夜景", "한국어 문장 테스트",
    "中文English混合", "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３", "ﬁne ﬂowers",
    "a red apple 🍎 on a leaf 🍃", "👩🏽‍🍳 woman cook", "🏳️‍🌈 flag", "😀😀😀",
    "zero\u200bwidth\u200cjoin\u200dhere", "soft\u00adhyphen", "bom\ufeffat start",
    "tab\tnew\nline\r\nreturn", "nbsp\u00a0and\u2009thin\u3000ideographic",
    "line\u2028separator\u2029paragraph", "bell\x07null\x00esc\x1bdel\x7f",
    "replacement \ufffd char", "private \ue000 use", "unassigned \U000e0fff code point",
    "\u200b\u200b\u200b", "\x00\x01\x02", "   \t\n  ", "",
    "combining e\u0301 a\u0300 o\u0308 n\u0303", "hebrew עברית arabic العربية",
    "devanagari हिन्दी thai ภาษาไทย", "[CLS] [SEP] [PAD] [MASK] [UNK]", "##ing ##s",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "x" * 100, "y" * 101, "pneumonoultramicroscopicsilicovolcanoconiosis " * 3,
    "one two three four five six seven eight nine ten eleven twelve thirteen",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "a very long prompt about " + "a red apple on a green leaf in the sun, " * 20,
)


def check_prompts() -> list[str]:
    """Every prompt of the shipped catalog (template, profiling and evaluation prompts,
    first occurrence order, no repeats) followed by :data:`HARD_PROMPTS`."""
    seen: dict[str, None] = {}
    for spec in load_catalog().values():
        for p in [spec.prompt, *spec.profiling_prompts, *spec.evaluation_prompts]:
            seen.setdefault(p, None)
    for p in HARD_PROMPTS:
        seen.setdefault(p, None)
    return list(seen)
