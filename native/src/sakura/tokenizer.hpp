// The text encoder's tokenizer in C++: BERT's basic tokenization and WordPiece, as the
// shipped MiniLM text encoder (dit/text.py) tokenizes a prompt, with no Python.
//
// dit/text.py lower-cases the prompt with Python's str.lower() and hands it to the model
// folder's Hugging Face tokenizer (tokenizers' BertNormalizer + BertPreTokenizer + WordPiece,
// truncation to max_tokens with [CLS] ... [SEP], padding with [PAD]). `encode` does the same:
//
//   1. str.lower(): full lower-case mapping (U+0130 -> "i\u0307") with Greek final sigma
//   2. clean: drop U+0000, U+FFFD and every Cc, Cf, Cs and Co character but \t \n \r
//      (unassigned ones stay); every White_Space character becomes ' '
//   3. a space either side of each CJK ideograph (tokenizers' ranges)
//   4. accents: NFD, then drop the nonspacing marks (Mn)
//   5. lower-case again, character by character (as the normalizer does)
//   6. split on spaces (dropped) and on punctuation (ASCII punctuation and Unicode P*; kept
//      as one-character words)
//   7. WordPiece per word: greedy longest match from the left, "##" continuations; a word
//      longer than 100 characters or with no match is one [UNK]
//   8. [CLS] + the first max_tokens - 2 pieces + [SEP], padded with [PAD] (mask 0)
//
// Unicode data (categories, NFD, case mappings) comes from utf8proc; what it has no
// property for is here: the White_Space list, the CJK ranges, Cased / Case_Ignorable of
// the final-sigma rule (Other_Lowercase / Other_Uppercase and the word-break MidLetter,
// MidNumLet and Single_Quote characters of Unicode 14, Python 3.11's), and the categories
// of steps 2, 4 and 6 as tokenizers sees them (its unicode_categories crate is Unicode 8.0:
// a character assigned since is a plain letter to it; tokenizer.cpp kSinceUnicode8).
// Checked against the reference on every code point in six contexts
// (scripts/text_encoder_check.py --codepoints).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace sakura {

// A prompt the tokenizer cannot take (not UTF-8) or a vocabulary it cannot use.
class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The vocabulary file does not exist or cannot be read.
class VocabularyNotFound : public TokenizerError {
 public:
  using TokenizerError::TokenizerError;
};

struct TokenizedPrompt {
  std::vector<std::int64_t> ids;   // max_tokens ids: [CLS] pieces [SEP] [PAD]...
  std::vector<std::int64_t> mask;  // 1 for [CLS] .. [SEP], 0 for the padding
  int total = 0;                   // tokens before truncation, [CLS] and [SEP] included
};

// The code points of `utf8`; throws TokenizerError naming the first invalid byte's offset
// (a truncated or overlong sequence, a surrogate, a value above U+10FFFF).
std::u32string decode_utf8(std::string_view utf8);
std::string encode_utf8(std::u32string_view text);

class WordPieceTokenizer {
 public:
  static constexpr int kMaxWordChars = 100;

  // One token per line of a BERT vocab.txt (the line number is the id; trailing
  // whitespace and \r are dropped). Throws VocabularyNotFound when the file cannot be
  // read, TokenizerError when [CLS], [SEP], [PAD] or [UNK] is missing.
  static WordPieceTokenizer from_file(const std::string& vocab_path);
  explicit WordPieceTokenizer(const std::vector<std::string>& tokens);

  std::size_t vocab_size() const { return vocab_.size(); }
  // The id of `token`, or -1.
  std::int64_t id(std::string_view token) const;

  // Steps 1-6: the words (UTF-8) of a prompt.
  std::vector<std::string> words(std::string_view prompt) const;
  // Step 7 for one word: its pieces' ids.
  std::vector<std::int64_t> wordpiece(std::string_view word) const;
  // Steps 1-7: every piece's id, no special tokens.
  std::vector<std::int64_t> piece_ids(std::string_view prompt) const;
  // Steps 1-8. max_tokens >= 2.
  TokenizedPrompt encode(std::string_view prompt, int max_tokens) const;

  std::int64_t cls_id() const { return cls_; }
  std::int64_t sep_id() const { return sep_; }
  std::int64_t pad_id() const { return pad_; }
  std::int64_t unk_id() const { return unk_; }

 private:
  std::unordered_map<std::string, std::int64_t> vocab_;
  std::int64_t cls_ = -1, sep_ = -1, pad_ = -1, unk_ = -1;
};

// Steps 1-5 of a prompt (the normalized text the words are split from); for tests.
std::u32string normalize_prompt(std::u32string_view prompt);

// utf8proc's version and Unicode version, e.g. "2.8.0 (Unicode 15.0.0)".
std::string unicode_library();

}  // namespace sakura
