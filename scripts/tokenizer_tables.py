"""Print the code-point table of native/src/sakura/tokenizer.cpp that utf8proc cannot give.

Hugging Face tokenizers' BERT normalizer and pre-tokenizer classify characters with the
``unicode_categories`` crate, whose tables are Unicode 8.0: a character assigned since
then is in none of them, so tokenizers treats it as a plain letter (kept, not split off,
not stripped as an accent) whatever its category now. utf8proc (2.8: Unicode 15.0) knows
those characters' categories, so the C++ tokenizer needs the ones among them whose
category matters (Mn: accents stripped; P*: split off; Cc / Cf / Cs / Co: removed).

Ages come from Perl's ``Unicode::UCD`` (Perl 5.36: Unicode 14.0); a character Perl calls
unassigned but utf8proc assigns is new in Unicode 15.0. Categories come from the system's
``libutf8proc`` through ctypes. Run: ``python scripts/tokenizer_tables.py`` and paste its
output over ``kSinceUnicode8``; ``scripts/text_encoder_check.py --codepoints`` checks the
result against the reference over every code point.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess

# utf8proc_category_t values of the categories the tokenizer acts on
MN = 6
PUNCT = range(12, 19)   # Pc Pd Ps Pe Pi Pf Po
OTHER = (26, 27, 28, 29)  # Cc Cf Cs Co
UNICODE8 = {"1.1", "2.0", "2.1", "3.0", "3.1", "3.2", "4.0", "4.1", "5.0", "5.1", "5.2",
            "6.0", "6.1", "6.2", "6.3", "7.0", "8.0"}


def ages() -> list[tuple[int, str]]:
    """Perl's Age inversion map: (first code point, age) runs."""
    out = subprocess.run(
        ["perl", "-MUnicode::UCD=prop_invmap", "-e",
         'my ($l, $m) = prop_invmap("Age"); print "$l->[$_] $m->[$_]\\n" for 0..$#$l'],
        capture_output=True, text=True, check=True).stdout
    return [(int(a), b) for a, b in (line.split(" ", 1) for line in out.splitlines())]


def main() -> None:
    lib = ctypes.CDLL(ctypes.util.find_library("utf8proc") or "libutf8proc.so.2")
    lib.utf8proc_category.restype = ctypes.c_int
    lib.utf8proc_category.argtypes = [ctypes.c_int32]
    lib.utf8proc_unicode_version.restype = ctypes.c_char_p
    runs = ages() + [(0x110000, "")]
    new = []
    for (lo, age), (hi, _) in zip(runs, runs[1:]):
        if age in UNICODE8:
            continue
        for c in range(lo, hi):
            cat = lib.utf8proc_category(c)
            if cat == 0:  # unassigned in Unicode 15 too
                continue
            if cat == MN or cat in PUNCT or cat in OTHER:
                new.append(c)
    ranges: list[list[int]] = []
    for c in new:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    print(f"// {len(new)} code points in {len(ranges)} ranges (utf8proc: Unicode "
          f"{lib.utf8proc_unicode_version().decode()}; ages: Perl's Unicode::UCD)")
    cells = [f"{{0x{a:04X}, 0x{b:04X}}}," for a, b in ranges]
    for i in range(0, len(cells), 4):
        print("    " + " ".join(cells[i:i + 4]))


if __name__ == "__main__":
    main()
