// TextEncoder: tokenizer + the encoder's compiled graph (see text_encoder.hpp).
#include "sakura/text_encoder.hpp"

#include <stdexcept>

namespace sakura {

TextEncoder::TextEncoder(const std::string& pte_path, const std::string& vocab_path)
    : tokenizer_(WordPieceTokenizer::from_file(vocab_path)), graph_(pte_path) {
  const auto& in = graph_.inputs();
  const auto& out = graph_.outputs();
  const bool ok = in.size() == 2 && out.size() == 1 && in[0].sizes.size() == 2 &&
                  in[0].sizes[0] == 1 && in[1].sizes == in[0].sizes &&
                  out[0].sizes.size() == 3 && out[0].sizes[0] == 1 &&
                  out[0].sizes[1] == in[0].sizes[1] && in[0].sizes[1] >= 2;
  if (!ok) {
    std::string got;
    for (const auto& s : in) got += (got.empty() ? "" : ", ") + s.describe();
    got += " -> ";
    for (const auto& s : out) got += s.describe() + " ";
    throw std::runtime_error(pte_path + " is not a text encoder program (ids [1, T], mask "
                             "[1, T] -> [1, T, D]; it has " + got + ")");
  }
  tokens_ = static_cast<int>(in[0].sizes[1]);
  dim_ = static_cast<int>(out[0].sizes[2]);
}

std::vector<float> TextEncoder::run(const std::vector<std::int64_t>& ids,
                                    const std::vector<std::int64_t>& mask) {
  const auto t = static_cast<std::size_t>(tokens_);
  if (ids.size() != t || mask.size() != t) {
    throw std::invalid_argument("the text encoder takes " + std::to_string(t) +
                                " ids and mask values, got " + std::to_string(ids.size()) +
                                " and " + std::to_string(mask.size()));
  }
  const auto vocab = static_cast<std::int64_t>(tokenizer_.vocab_size());
  std::vector<float> fid(t), fmask(t);
  for (std::size_t i = 0; i < t; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab || (mask[i] != 0 && mask[i] != 1)) {
      throw std::invalid_argument("token " + std::to_string(i) + ": id " +
                                  std::to_string(ids[i]) + " / mask " +
                                  std::to_string(mask[i]) + " out of range");
    }
    fid[i] = static_cast<float>(ids[i]);
    fmask[i] = static_cast<float>(mask[i]);
  }
  std::vector<float> out(t * static_cast<std::size_t>(dim_));
  graph_.run({{fid.data(), {1, tokens_}}, {fmask.data(), {1, tokens_}}}, {out.data()});
  return out;
}

std::vector<float> TextEncoder::encode(std::string_view prompt) {
  const TokenizedPrompt tok = tokenizer_.encode(prompt, tokens_);
  return run(tok.ids, tok.mask);
}

}  // namespace sakura
