// What `sakura-edge` computes around the shard loop, without Python: the template's assets
// (base64 PNGs of the catalog entry, decoded with libpng), the bundle's float32 tables, the
// edit's starting noise (torch.randn's CPU algorithm, so a seed gives the same latent as the
// Python runtime), the request tensors of `edge.native_runtime.NativeEngine.inputs`, and the
// composed image (`dit.editing.compose`) with its PNG (`edge.cli.save_image`'s rounding).
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "sakura/edit.hpp"

namespace sakura::edge {

// Bad input (a file, an answer of the origin, a prompt): the binary's exit 1.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string base64_decode(const std::string& text, const std::string& what);

struct Image {
  int width = 0, height = 0, channels = 0;  // channels: 1 (gray) or 3 (RGB)
  std::vector<std::uint8_t> pixels;         // row-major, interleaved
};

// A PNG held in memory; `channels` 3: RGB (alpha dropped), 1: the first channel (a mask,
// dit/images.py read_mask). Throws InputError naming `what`.
Image read_png(const std::string& data, int channels, const std::string& what);
// 8-bit RGB PNG; throws std::runtime_error.
void write_png(const std::string& path, const std::vector<std::uint8_t>& rgb, int width,
               int height);
// float32 array as .npy (little-endian, C order).
void write_npy(const std::string& path, const std::vector<float>& data,
               const std::vector<std::int64_t>& shape);

// torch.randn(n, generator=torch.Generator().manual_seed(seed)) on the CPU (mt19937, 24-bit
// uniforms, Box-Muller over blocks of 16, the last block redrawn); n >= 16. Equal up to the
// last bits of log / cos / sin (torch evaluates them with SLEEF's vectorised functions).
std::vector<float> torch_randn(std::int64_t n, std::uint64_t seed);

// The bundle's tables.bin (edge/bundle.py write_tables): float32 arrays by name.
struct Tables {
  std::map<std::string, std::pair<std::vector<std::int64_t>, std::vector<float>>> arrays;
  const std::vector<float>& get(const std::string& name,
                                const std::vector<std::int64_t>& shape) const;
  const std::vector<std::int64_t>& shape(const std::string& name) const;
};
// `index`: {name: {offset, shape}} from the catalog's bundle entry.
Tables read_tables(const std::string& path, const std::map<std::string,
                   std::pair<std::int64_t, std::vector<std::int64_t>>>& index);

// The template as the device sees it (dit/templates.py device_template + Geometry.of).
struct TemplateView {
  int size = 0, patch = 0, grid = 0, channels = 3;
  int steps = 0;
  double guidance = 1.0, strength = 1.0;
  std::int64_t seed = -1;                  // the template's noise seed (-1: unknown)
  std::vector<float> image;                // [3, size, size] in [-1, 1]
  std::vector<std::int64_t> masked, unmasked;  // token indices
  std::vector<float> tokens() const;       // patchify(image): [N, P]
  int patch_dim() const { return channels * patch * patch; }
  int num_tokens() const { return grid * grid; }
};
TemplateView template_view(const std::string& image_png, const std::string& mask_png,
                           int patch);

// The edit's request tensors (NativeEngine.inputs): `txt` is [B, T, D] after txt_in; `full`:
// every token with the unmasked ones pinned (the local fallback's graphs); `dynamic`: graphs
// with dynamic sizes take the image rows of the RoPE tables only.
EditInputs edit_inputs(const TemplateView& tv, const Tables& tables, std::vector<float> txt,
                       int batch, int txt_tokens, std::uint64_t seed, bool full, bool dynamic);

// compose(): the template outside the mask, the latent's rows inside, clamped to [-1, 1]:
// [3, size, size]; `full`: x holds every token.
std::vector<float> compose(const TemplateView& tv, const std::vector<float>& x, bool full);
// edge.cli.save_image's bytes: round((clamp(v) + 1) * 127.5), HWC.
std::vector<std::uint8_t> to_rgb8(const std::vector<float>& chw, int size);

// txt_in: x [rows, in] -> x W^T + b [rows, out].
std::vector<float> linear(const std::vector<float>& x, const std::vector<float>& weight,
                          const std::vector<float>& bias, std::int64_t in, std::int64_t out);

}  // namespace sakura::edge
