"""The native text side against the Python one (issue 31): writes one JSON file.

Over every prompt of ``sakura.edge.backends.text_encoder.check_prompts()`` (the shipped
catalog's prompts and the hard cases of the tests):

* ``token_ids_identical``: the C++ tokenizer's ids and attention masks
  (``sakura_native.Tokenizer``) equal the Hugging Face tokenizer's as ``dit/text.py`` calls
  it (lower-cased, truncated and padded to 16), and so do the untruncated pieces;
* ``max_abs_err_vs_torch``: the ExecuTorch program run by the C++ runtime
  (``sakura_native.TextEncoder.encode``, tokenizer included) against
  ``TextEncoder.encode``, over all 16 positions (``..._real_tokens``: [CLS] .. [SEP] only),
  with the float64 model as a yardstick for both;
* the export's wall time and the ``.pte``'s size (``--fresh``: exported now into a
  temporary cache, else the cached program's recorded time), per-prompt times;
* ``--codepoints``: every code point (surrogates excepted) in six contexts through both
  tokenizers (about 4 minutes; the Hugging Face side takes most of it).

    python scripts/text_encoder_check.py --fresh --codepoints --json docs/bench/text-encoder.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import sakura_native
import torch
from sakura.dit.text import TextEncoder
from sakura.edge.backends.text_encoder import (
    HARD_PROMPTS,
    check_prompts,
    compiled_text_encoder,
    load_minilm,
)

MAX_TOKENS = 16
# "{}" is the code point: alone, inside a word, before a combining accent, and the three
# sides of Python's final-sigma rule
CONTEXTS = ("{}", "a{}b", "x{}\u0301y", "{}\u03a3", "a\u03a3{}", "a{}\u03a3")


def median_ms(fn, items) -> float:
    out = []
    for x in items:
        t0 = time.perf_counter()
        fn(x)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def check_tokens(tok, hf, prompts: list[str]) -> dict:
    want = hf([p.lower() for p in prompts], padding="max_length", truncation=True,
              max_length=MAX_TOKENS)
    differ = []
    for i, p in enumerate(prompts):
        ids, mask = tok.encode(p, MAX_TOKENS)
        pieces = hf(p.lower(), add_special_tokens=False)["input_ids"]
        if (ids.tolist() != want["input_ids"][i] or mask.tolist() != want["attention_mask"][i]
                or tok.pieces(p) != pieces):
            differ.append(p)
    return {"token_ids_identical": not differ, "differing_prompts": differ,
            "truncated_prompts": sum(len(hf(p.lower())["input_ids"]) > MAX_TOKENS
                                     for p in prompts)}


def check_codepoints(tok, hf) -> dict:
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    out = {"codepoints": len(cps), "contexts": list(CONTEXTS), "mismatches": {}}
    for ctx in CONTEXTS:
        texts = [ctx.format(chr(c)) for c in cps]
        want = hf([t.lower() for t in texts], add_special_tokens=False)["input_ids"]
        bad = [f"U+{c:04X}" for c, t, w in zip(cps, texts, want) if tok.pieces(t) != w]
        out["mismatches"][ctx] = {"count": len(bad), "first": bad[:20]}
    out["total_mismatches"] = sum(v["count"] for v in out["mismatches"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=Path("docs/bench/text-encoder.json"))
    ap.add_argument("--fresh", action="store_true",
                    help="export into a temporary cache now (times the export)")
    ap.add_argument("--codepoints", action="store_true",
                    help="also compare every code point in six contexts (~4 min)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core each side: the per-prompt times compare engines
    sakura_native.set_graph_threads(1)

    prompts = check_prompts()
    enc = TextEncoder(MAX_TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        program = compiled_text_encoder(MAX_TOKENS, Path(tmp) if args.fresh else None)
        native = sakura_native.TextEncoder(str(program.pte), str(program.vocab))
        tok = sakura_native.Tokenizer(str(program.vocab))
        pte_bytes = program.pte.stat().st_size
        res: dict = {"prompts": len(prompts), "catalog_prompts": len(prompts) - len(HARD_PROMPTS),
                     "hard_prompts": len(HARD_PROMPTS)}
        res.update(check_tokens(tok, enc.tokenizer, prompts))

        want = enc.encode(prompts).numpy()
        got = np.stack([native.encode(p) for p in prompts])
        err = np.abs(got - want)
        real = np.array([tok.encode(p, MAX_TOKENS)[1] for p in prompts], dtype=bool)
        batch = enc.tokenizer([p.lower() for p in prompts], padding="max_length",
                              truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        with torch.no_grad():
            f64 = load_minilm().double()(**batch).last_hidden_state.numpy()
        per_prompt = err.max(axis=(1, 2))
        res.update({
            "max_abs_err_vs_torch": float(err.max()),
            "max_abs_err_real_tokens": float(err[real].max()),
            "median_prompt_max_abs_err": float(np.median(per_prompt)),
            "worst_prompt": prompts[int(per_prompt.argmax())],
            "max_abs_err_vs_float64": {"torch_fp32": float(np.abs(want - f64).max()),
                                       "pte_native": float(np.abs(got - f64).max())},
            "output_abs_max": float(np.abs(want).max()),
            "export_s": program.export_s, "exported_this_run": program.exported,
            "pte_bytes": pte_bytes, "delegation": program.delegation.to_dict(),
            "ms_per_prompt": {
                "native_tokenize": median_ms(lambda p: tok.encode(p, MAX_TOKENS), prompts),
                "hf_tokenize": median_ms(
                    lambda p: enc.tokenizer([p.lower()], padding="max_length",
                                            truncation=True, max_length=MAX_TOKENS), prompts),
                "native_encode": median_ms(native.encode, prompts),
                "torch_encode": median_ms(lambda p: enc.encode([p]), prompts)},
            "threads": {"torch": torch.get_num_threads(),
                        "xnnpack": sakura_native.set_graph_threads(0)},
            "host_cpus": os.cpu_count(),
            "unicode_library": sakura_native.unicode_library(),
        })
    if args.codepoints:
        res["codepoint_check"] = check_codepoints(tok, enc.tokenizer)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: res[k] for k in ("prompts", "token_ids_identical",
                                          "max_abs_err_vs_torch", "export_s", "pte_bytes")}))


if __name__ == "__main__":
    main()
