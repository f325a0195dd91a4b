// The text side of an edit without Python: prompt -> WordPiece ids (tokenizer.hpp) -> the
// MiniLM encoder's ExecuTorch program (edge/backends/text_encoder.py exports it) -> the
// [max_tokens, dim] token embeddings the DiT takes (dit/text.py's TextEncoder.encode).
//
// The program takes the ids and the attention mask as float32 [1, T] (CompiledGraph's
// tensors are float32; ids below 2^24 are exact) and returns last_hidden_state
// float32 [1, T, D]. Not thread-safe (one CompiledGraph).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "sakura/graph.hpp"
#include "sakura/tokenizer.hpp"

namespace sakura {

class TextEncoder {
 public:
  // Throws VocabularyNotFound / TokenizerError for the vocabulary, std::runtime_error for a
  // program that is not [1, T], [1, T] -> [1, T, D].
  TextEncoder(const std::string& pte_path, const std::string& vocab_path);

  int max_tokens() const { return tokens_; }
  int dim() const { return dim_; }
  const WordPieceTokenizer& tokenizer() const { return tokenizer_; }

  // The embeddings of a tokenized prompt (ids and mask of max_tokens values): T * D floats.
  std::vector<float> run(const std::vector<std::int64_t>& ids,
                         const std::vector<std::int64_t>& mask);
  // tokenize + run.
  std::vector<float> encode(std::string_view prompt);

 private:
  WordPieceTokenizer tokenizer_;
  CompiledGraph graph_;
  int tokens_ = 0, dim_ = 0;
};

}  // namespace sakura
