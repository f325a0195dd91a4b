"""The text side of an edit without Python (issue 31): the C++ WordPiece tokenizer
(``sakura_native.Tokenizer`` / ``tokenize``) against the Hugging Face tokenizer as
``dit/text.py`` calls it, and the MiniLM encoder's ExecuTorch program run by the C++
runtime (``sakura_native.TextEncoder``) against ``TextEncoder.encode``.

The program is exported once into the compiled-artifact cache (``sakura.cachedir``:
``compiled/text_encoder/``, about a minute the first time) and found there afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from sakura.dit.templates import load_catalog
from sakura.dit.text import minilm_dir
from sakura.edge.backends.text_encoder import (
    HARD_PROMPTS,
    check_prompts,
    compiled_text_encoder,
)

sakura_native = pytest.importorskip(
    "sakura_native", reason="sakura_native is not built (pip install ./native)")

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def vocab():
    ok, why = sakura_native.tokenizer_available()
    if not ok:
        pytest.skip(f"sakura_native has no tokenizer: {why}")
    return str(minilm_dir() / "vocab.txt")


@pytest.fixture(scope="module")
def tokenizer(vocab):
    return sakura_native.Tokenizer(vocab)


@pytest.fixture(scope="session")
def text_program():
    ok, why = sakura_native.text_encoder_available()
    if not ok:
        pytest.skip(f"sakura_native cannot run the text encoder: {why}")
    return compiled_text_encoder(MAX_TOKENS)


@pytest.fixture(scope="session")
def native_encoder(text_program):
    # the runtime's graph thread count (NativeEngine: 1) before a program that lives for the
    # session loads: the count cannot change under it afterwards
    sakura_native.set_graph_threads(1)
    return sakura_native.TextEncoder(str(text_program.pte), str(text_program.vocab))


def hf_encode(text_encoder, prompts, max_length=MAX_TOKENS):
    """Ids and masks exactly as ``TextEncoder.encode`` tokenizes."""
    tok = text_encoder.tokenizer([p.lower() for p in prompts], padding="max_length",
                                 truncation=True, max_length=max_length)
    return tok["input_ids"], tok["attention_mask"]


def test_the_prompts_cover_the_catalog_and_the_hard_cases():
    prompts = check_prompts()
    catalog = {p for s in load_catalog().values()
               for p in [s.prompt, *s.profiling_prompts, *s.evaluation_prompts]}
    assert catalog <= set(prompts) and set(HARD_PROMPTS) <= set(prompts)
    assert len(prompts) >= 100 and len(HARD_PROMPTS) >= 50


def test_token_ids_identical_to_the_hf_tokenizer(tokenizer, vocab, text_encoder):
    prompts = check_prompts()
    ids, masks = hf_encode(text_encoder, prompts)
    for p, want_ids, want_mask in zip(prompts, ids, masks):
        got_ids, got_mask = tokenizer.encode(p, MAX_TOKENS)
        assert got_ids.dtype == np.int64 and got_mask.dtype == np.int64
        assert got_ids.tolist() == want_ids, repr(p)
        assert got_mask.tolist() == want_mask, repr(p)
        # untruncated: every piece, and the (kept, total) counts of TextEncoder.token_counts
        pieces = text_encoder.tokenizer(p.lower(), add_special_tokens=False)["input_ids"]
        assert tokenizer.pieces(p) == pieces, repr(p)
        kept, total = text_encoder.token_counts(p)
        assert (int(got_mask.sum()), len(pieces) + 2) == (kept, total), repr(p)
    # the one-call form and UTF-8 bytes give the same
    for p in prompts[::7]:
        a, m = sakura_native.tokenize(p, vocab, MAX_TOKENS)
        b, n = tokenizer.encode(p.encode("utf-8"), MAX_TOKENS)
        assert a.tolist() == b.tolist() and m.tolist() == n.tolist()
    # truncation and padding at other lengths
    for length in (2, 5, 32):
        ids, masks = hf_encode(text_encoder, prompts[::5], length)
        for p, want_ids, want_mask in zip(prompts[::5], ids, masks):
            got_ids, got_mask = tokenizer.encode(p, length)
            assert (got_ids.tolist(), got_mask.tolist()) == (want_ids, want_mask), (length, p)


def test_hard_cases_do_what_bert_does(tokenizer):
    assert tokenizer.words("Café, NAÏVE Ångström Zoë!") == [
        "cafe", ",", "naive", "angstrom", "zoe", "!"]
    assert tokenizer.words("ΟΔΟΣ ΣΟΦΙΑΣ") == ["οδος", "σοφιας"]  # final sigma, accents off
    assert tokenizer.words("中文English") == ["中", "文", "english"]
    assert tokenizer.words("zero\u200bwidth\x00ctrl\u2028line") == ["zerowidthctrl", "line"]
    assert tokenizer.words("\u200b\x00\t ") == []
    ids, mask = tokenizer.encode("\u200b\x00\t ", MAX_TOKENS)  # empty after cleaning
    assert ids.tolist()[:3] == [tokenizer.id("[CLS]"), tokenizer.id("[SEP]"), 0]
    assert mask.sum() == 2
    assert tokenizer.pieces("x" * 101) == [tokenizer.id("[UNK]")]  # > 100 characters
    long = tokenizer.encode("apple " * 40, MAX_TOKENS)
    assert long[1].sum() == MAX_TOKENS and long[0][-1] == tokenizer.id("[SEP]")


def test_vocabulary_ids_are_the_hf_tokenizers(tokenizer, text_encoder):
    vocab = text_encoder.tokenizer.get_vocab()
    assert tokenizer.vocab_size == len(vocab)
    assert all(tokenizer.id(token) == i for token, i in vocab.items())
    assert tokenizer.id("no-such-token") == -1


def test_code_point_sample_matches(tokenizer, text_encoder):
    # every code point in three contexts is what scripts/text_encoder_check.py --codepoints
    # checks (about 4 minutes); here a sample: the first 0x800 and every 61st after
    cps = [c for c in list(range(0x800)) + list(range(0x800, 0x110000, 61))
           if not 0xD800 <= c <= 0xDFFF]
    for pattern in ("a{}b", "a{}\u03a3"):  # the second: case-ignorable before a final sigma
        texts = [pattern.format(chr(c)) for c in cps]
        want = text_encoder.tokenizer([t.lower() for t in texts],
                                      add_special_tokens=False)["input_ids"]
        bad = [hex(c) for c, t, w in zip(cps, texts, want) if tokenizer.pieces(t) != w]
        assert not bad, f"{pattern!r}: {len(bad)} code points differ: {bad[:10]}"


def test_compiled_encoder_matches_torch(text_program, native_encoder, text_encoder, tokenizer):
    assert text_program.pte.stat().st_size > 80e6  # fp32 weights
    assert text_program.vocab.read_bytes() == (minilm_dir() / "vocab.txt").read_bytes()
    assert text_program.delegation.delegated_ops > 0
    assert (native_encoder.max_tokens, native_encoder.dim) == (MAX_TOKENS, text_encoder.dim)
    prompts = check_prompts()[::10]  # 12, catalog and hard cases
    assert len(prompts) >= 12
    want = text_encoder.encode(prompts).numpy()
    got = np.stack([native_encoder.encode(p) for p in prompts])
    assert got.shape == want.shape == (len(prompts), MAX_TOKENS, text_encoder.dim)
    # the tokens the prompt fills: 4.8e-6 at worst over all 120 prompts
    # (docs/bench/text-encoder.json); padding positions are ill-conditioned in fp32 (torch's
    # own fp32 output is 4.7e-5 from a float64 run there, the program's 6.4e-5, 8.0e-5
    # apart on this CPU): a looser bound, so another CPU's rounding does not fail it
    real = np.stack([tokenizer.encode(p, MAX_TOKENS)[1] for p in prompts]).astype(bool)
    assert float(np.abs(got - want)[real].max()) <= 1e-4
    assert float(np.abs(got - want).max()) <= 1e-3
    ids, mask = tokenizer.encode(prompts[0], MAX_TOKENS)
    assert np.array_equal(native_encoder.run(ids.tolist(), mask.tolist()), got[0])
    # the second lookup finds the program in the cache
    again = compiled_text_encoder(MAX_TOKENS)
    assert again.folder == text_program.folder and not again.exported


def test_bad_input_is_one_clear_error(tokenizer, vocab, native_encoder, text_program, tmp_path):
    for bad, what in ((b"caf\xe9 au lait", "byte 0xE9 at offset 3"),  # Latin-1, not UTF-8
                      (b"\xc0\x80", "byte 0xC0 at offset 0"),          # overlong NUL
                      (b"\xed\xa0\x80", "byte 0xED at offset 0"),      # a surrogate
                      (b"ok \xf0\x9f\x8d", "byte 0xF0 at offset 3"),   # truncated
                      ("lone \ud800 surrogate", "lone surrogate")):
        for call in (lambda b: tokenizer.encode(b), lambda b: sakura_native.tokenize(b, vocab),
                     lambda b: tokenizer.words(b), lambda b: native_encoder.encode(b)):
            with pytest.raises(sakura_native.TokenizerError, match="not valid UTF-8") as info:
                call(bad)
            assert what in str(info.value)
            assert isinstance(info.value, ValueError)
    with pytest.raises(TypeError, match="str or bytes"):
        tokenizer.encode(42)
    missing = str(tmp_path / "nowhere" / "vocab.txt")
    for call in (lambda: sakura_native.Tokenizer(missing),
                 lambda: sakura_native.tokenize("a prompt", missing),
                 lambda: sakura_native.TextEncoder(str(text_program.pte), missing)):
        with pytest.raises(FileNotFoundError, match="cannot read the tokenizer vocabulary") as info:
            call()
        assert missing in str(info.value)
    not_bert = tmp_path / "vocab.txt"
    not_bert.write_text("hello\nworld\n[CLS]\n")
    with pytest.raises(sakura_native.TokenizerError, match=r"no \[SEP\], \[PAD\], \[UNK\]"):
        sakura_native.Tokenizer(str(not_bert))
    with pytest.raises(sakura_native.TokenizerError, match="max_tokens must be >= 2"):
        tokenizer.encode("a", 1)
    with pytest.raises(RuntimeError, match="cannot open compiled graph"):
        sakura_native.TextEncoder(str(tmp_path / "missing.pte"), vocab)
    with pytest.raises(ValueError, match="takes 16 ids"):
        native_encoder.run([101, 102], [1, 1])


def test_the_thread_count_cannot_change_under_a_loaded_program(text_program, vocab):
    """A program loaded before ``set_graph_threads`` replaced ExecuTorch's threadpool held
    the old pool and segfaulted on its next run (issue 31). Now the count already in effect
    is a no-op, a change while a program is loaded is one RuntimeError (the program still
    runs), and once no program is loaded the change is made. In a child process: the pool is
    process-wide, and a regression would crash the interpreter, not fail an assert."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sakura_native as n
        enc = n.TextEncoder({str(text_program.pte)!r}, {vocab!r})
        before = enc.encode("a red circle")
        now = n.set_graph_threads(0)
        assert n.set_graph_threads(now) == now
        try:
            n.set_graph_threads(now + 1)
        except RuntimeError as exc:
            assert "while 1 programs are loaded" in str(exc), exc
        else:
            raise SystemExit("no error")
        assert (enc.encode("a red circle") == before).all()
        del enc
        assert n.set_graph_threads(now + 1) == now + 1
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
